"""The worker's configuration checked before it loads anything: the device exists, the checkpoint's family
is registered, the tensor-parallel size divides the model's heads, --max-model-len fits the model, and the
scheduler's address is one. A failure is a ConfigError naming the flag (common/preflight.py): the worker
exits 2 with one line, which its supervisor does not restart.

`python -m pagedserve.worker.preflight [flags]` runs the checks alone (the config from flags and PAGEDSERVE_*,
as the worker reads it): `pagedserve serve` runs it before it starts any process.
"""

from __future__ import annotations

import re
import sys

from pagedserve.common.config import WorkerConfig, parse_config
from pagedserve.common.preflight import ConfigError, check_connect_address, exit_config_error
from pagedserve.worker.model_config import ModelConfig, resolve_max_model_len

_DEVICE = re.compile(r"(auto|cpu|cuda)(:(\d+))?")


def check_device(device: str) -> None:
    """`device` is auto, cpu, cuda or cuda:N of a GPU this host has."""
    match = _DEVICE.fullmatch(device)
    if match is None or (match.group(2) and match.group(1) != "cuda"):
        raise ConfigError("--device", f"{device!r} is not auto, cpu, cuda or cuda:N")
    if match.group(1) != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--device", f"{device!r} asked for, but torch finds no CUDA GPU on this host")
    index = int(match.group(3) or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("--device", f"{device!r}: this host has {torch.cuda.device_count()} CUDA GPU(s)")


def check_worker_config(cfg: WorkerConfig) -> ModelConfig:
    """The checkpoint's ModelConfig, once `cfg` is known to work with it; raises ConfigError otherwise."""
    from pagedserve.worker.loader import load_model_config  # torch and every family: after the cheap checks
    from pagedserve.worker.models.registry import UnsupportedModelError
    from pagedserve.worker.parallel import shard_model_config

    check_connect_address(cfg.worker_address, "--worker-address")
    check_device(cfg.device)
    try:
        model_config = load_model_config(cfg.model, cfg.quantization)
    except (OSError, UnsupportedModelError) as e:
        raise ConfigError("--model", str(e)) from None
    except (KeyError, ValueError, TypeError) as e:  # a config.json without a field every family needs
        raise ConfigError("--model", f"{cfg.model}/config.json cannot be read: {e!r}") from None
    size = cfg.tensor_parallel_size
    if size < 1 or not 0 <= cfg.rank < size:
        raise ConfigError("--tensor-parallel-size", f"{size} with rank {cfg.rank}: need 0 <= rank < size")
    try:
        shard_model_config(model_config, size)
    except ValueError as e:
        raise ConfigError("--tensor-parallel-size", str(e)) from None
    try:
        resolve_max_model_len(cfg, model_config)
    except ValueError as e:
        raise ConfigError("--max-model-len", str(e)) from None
    if cfg.max_model_len < 0:
        raise ConfigError("--max-model-len", f"{cfg.max_model_len} is negative (0: the model's own limit)")
    return model_config


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(WorkerConfig, argv, description="checks the worker's configuration, then exits")
    try:
        check_worker_config(cfg)
    except ConfigError as e:
        exit_config_error("worker", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
