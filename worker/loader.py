"""Reads a local Hugging Face checkpoint's weights (safetensors) into the worker's own modules, fusing q/k/v
and gate/up, and reading only a tensor-parallel rank's shard of each tensor (worker/model_config.py reads its
config.json).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model_config import ModelConfig
from worker.parallel import ParallelContext

# Per-layer scales of an FP8 KV cache as quantized checkpoints store them (one number each); without them
# the scales stay 1.0 (worker/model.py LlamaAttention).
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """The names of the checkpoint's tensors, read from the file headers (no tensor data)."""
    names: list[str] = []
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_checkpoint_tensors(
    model_dir: str | Path,
    device: torch.device,
    select: Callable[[str], tuple[slice, ...] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read one at a time straight onto `device`; where `select`
    gives slices for a name, only that part of the tensor is read (a tensor-parallel rank's shard)."""
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                slices = select(name) if select is not None else None
                if slices is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, f.get_slice(name)[slices].to(device)


# Checkpoint projections that the worker stores fused: (fused parameter, index of the shard within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str) -> tuple[str, int] | None:
    """('...qkv_proj.weight', shard) for a q/k/v or gate/up checkpoint name, else None."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return None


def _shard_rows(config: ModelConfig, fused_name: str, shard: int) -> tuple[int, int]:
    if "qkv_proj" in fused_name:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    else:
        sizes = [config.intermediate_size, config.intermediate_size]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def _rank_slices(name: str, local: ModelConfig, vocab_rows: int, rank: int) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` that tensor-parallel rank `rank` holds (None: all of it), given
    the rank's layer shapes `local` and its rows of the vocabulary. q/k/v and gate/up (weights and biases)
    are split by output rows, o_proj and down_proj weights by input columns, the embedding and the LM head
    by vocabulary rows; norms and the row-parallel biases are whole on every rank."""
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    rows = {
        "q_proj": local.q_size,
        "k_proj": local.kv_size,
        "v_proj": local.kv_size,
        "gate_proj": local.intermediate_size,
        "up_proj": local.intermediate_size,
        "embed_tokens": vocab_rows,
        "lm_head": vocab_rows,
    }.get(proj)
    if rows is not None:  # the last vocabulary slice may run past the end: the slice stops there
        return (slice(rank * rows, (rank + 1) * rows),)
    cols = {"o_proj": local.q_size, "down_proj": local.intermediate_size}.get(proj)
    if cols is not None and parts[-1] == "weight":
        return (slice(None), slice(rank * cols, (rank + 1) * cols))
    return None


def load_weights(
    model: torch.nn.Module,
    config: ModelConfig,
    model_dir: str | Path,
    parallel: ParallelContext | None = None,
) -> None:
    """Copies the checkpoint's tensors into `model` (whose parameters are already on the target device and
    dtype), fusing q/k/v and gate/up, and tying lm_head to the embedding where the checkpoint says so. With
    a tensor-parallel `parallel` of more than one rank, reads only this rank's shard of each tensor."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[str] = set()
    select = None
    if parallel is not None and parallel.world_size > 1:
        local = parallel.shard_model_config(config)
        vocab_rows = parallel.vocab_shard(config.vocab_size)[1]
        config = local  # the fused rows below are this rank's

        def select(name: str) -> tuple[slice, ...] | None:
            return _rank_slices(name.removeprefix("model."), local, vocab_rows, parallel.rank)

    for ckpt_name, tensor in iter_checkpoint_tensors(model_dir, device, select):
        name = ckpt_name.removeprefix("model.")
        if "rotary_emb" in name:  # older checkpoints store inv_freq; the worker computes its own
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(KV_SCALE_NAMES):  # an FP8 KV cache's per-tensor scales: plain floats on the layer
            if tensor.numel() != 1:  # per-head or per-channel scales: not what the kernels apply
                raise ValueError(
                    f"{ckpt_name}: one per-tensor scale expected, got shape {tuple(tensor.shape)}"
                )
            module, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(module), attr, tensor.item())
            continue
        fused = _fused_target(name)
        if fused is not None:
            target_name, shard = fused
            start, end = _shard_rows(config, target_name, shard)
            target = params[target_name][start:end]
            loaded.add(f"{target_name}#{shard}")
        elif name in params:
            target = params[name]
            loaded.add(name)
            if select is not None and name in ("embed_tokens.weight", "lm_head.weight"):
                with torch.no_grad():  # the last rank's vocabulary slice is padded with zero rows
                    target[tensor.shape[0] :].zero_()
                target = target[: tensor.shape[0]]
        else:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        if target.shape != tensor.shape:
            shapes = f"checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
            raise ValueError(f"{ckpt_name}: shape mismatch: {shapes}")
        with torch.no_grad():
            target.copy_(tensor)

    if "lm_head.weight" not in loaded:
        # Tied, or a checkpoint that simply has no lm_head: the output projection is the embedding.
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    expected = set()
    for name in params:
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected.update(f"{name}#{i}" for i in range(3))
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            expected.update(f"{name}#{i}" for i in range(2))
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}")
