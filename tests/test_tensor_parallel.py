"""Tensor parallelism over gloo on the CPU: two ranks give what one process gives.

Rank 0 runs the real scheduler core and forwards each StepPlan to rank 1 the way the worker does
(`ParallelContext.forward_to_followers`); rank 1 runs the worker's follower loop. The plans cover chunked
prefill beside decodes, prefix-cache hits, preemption by swap and by recompute, greedy and seeded sampling;
the checkpoints cover Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied embeddings), a vocabulary that
two ranks do not split evenly with biases on every projection, and Qwen3-MoE (each expert split as the
dense MLP). Every token must equal the single process's, every logits row must agree closely with its row,
and the two ranks must agree exactly with each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from pagedserve.common.config import WorkerConfig
from pagedserve.common.log import get_logger
from pagedserve.common.messages import SamplingParams, Shutdown, StepOutput, encode
from pagedserve.worker import server
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.parallel import (
    ParallelContext,
    honcho_rank,
    init_parallel,
    shard_model_config,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from scripts._servers import free_port
from scripts.make_model import make_model
from tests.engine_loop import run_engine
from tests.test_engine_correctness import _prompts
from tests.test_moe import make_tiny_moe

WORLD_SIZE = 2
# The GPU variants' marks (tests/*tensor_parallel_gpu.py): on the device, with WORLD_SIZE CUDA devices
ON_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} CUDA devices"),
]
MAX_TOKENS = 8
NUM_KV_BLOCKS = 24  # of 4 tokens: small enough that the prompts below preempt one another
NUM_CPU_BLOCKS = 64  # the scheduler's swap pool, the same for both runs (the ranks' pools hold more)
TIMEOUT_S = 120.0
CHECKPOINTS = ("tiny", "qwen2-tiny", "qwen3-tiny", "odd-vocab-biases", "qwen3-moe")


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny": tiny_model_dir,
        "qwen2-tiny": make_model(root / "qwen2-tiny", preset="qwen2-tiny", seed=0),
        "qwen3-tiny": make_model(root / "qwen3-tiny", preset="qwen3-tiny", seed=0),
        "odd-vocab-biases": _odd_vocab_with_biases(tiny_model_dir, root / "odd-vocab-biases", 4093),
        "qwen3-moe": make_tiny_moe(root / "qwen3-moe", "qwen3_moe"),  # each expert split as the dense MLP
    }


@pytest.fixture(scope="module")
def tensor_parallel_runs(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """What each rank of one two-rank group recorded on each checkpoint (one group for all: spawning and
    joining it is most of the cost)."""
    out_dir = tmp_path_factory.mktemp("tensor-parallel")
    _run_ranks(checkpoints, out_dir)
    return {
        name: [torch.load(out_dir / f"{name}-rank{rank}.pt") for rank in range(WORLD_SIZE)]
        for name in checkpoints
    }


def _odd_vocab_with_biases(src: Path, dst: Path, vocab_size: int) -> Path:
    """The Llama checkpoint at `src` cut to its first `vocab_size` tokens (two ranks hold 2047 + 2046 rows),
    with random biases on every projection: the row-parallel ones (o_proj, down_proj) must be added once."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab_size].contiguous()
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        rows = tensors[name].shape[0]
        tensors[name.removesuffix("weight") + "bias"] = torch.rand(rows, generator=generator) - 0.5
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config |= {"vocab_size": vocab_size, "attention_bias": True, "mlp_bias": True}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _worker_config(model_dir: Path, device: str = "cpu", **kw: Any) -> WorkerConfig:
    """float32 on the CPU, or on CUDA (the Triton kernels, CUDA graphs for decodes up to 8 sequences)."""
    return WorkerConfig(
        model=str(model_dir), device=device, dtype="float32", block_size=4, num_kv_blocks=NUM_KV_BLOCKS,
        swap_space=0.05, max_num_seqs=8, **kw,
    )  # fmt: skip


class Recorder:
    """Every StepOutput a runner returns and every logits row it computes, in order."""

    def __init__(self, runner: ModelRunner) -> None:
        self.outputs: list[tuple[int, list[int], list[int]]] = []
        self.logits: list[torch.Tensor] = []
        finish, compute_logits = runner.finish, runner.model.compute_logits

        def recording_finish() -> StepOutput:  # every step ends here, through execute() or the worker loop
            out = finish()
            self.outputs.append((out.step_id, list(out.seq_ids), list(out.token_ids)))
            return out

        def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            self.logits.append(logits.clone())
            return logits

        runner.finish = recording_finish
        runner.model.compute_logits = recording_logits

    def result(self, **extra: Any) -> dict[str, Any]:
        return {"outputs": self.outputs, "logits": torch.cat(self.logits).cpu(), **extra}


def _run_engine(runner: ModelRunner, parallel: ParallelContext) -> dict[tuple[int, int], list[int]]:
    """Greedy and seeded requests through the scheduler core (tests/engine_loop.py), each plan forwarded to
    the other ranks."""
    prompts = _prompts(runner.vocab_size)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    seeded = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7)
    requests = [(prompt, greedy) for prompt in prompts] + [(prompts[4], seeded)]
    forward = lambda plan: parallel.forward_to_followers(encode(plan))  # noqa: E731
    run = run_engine(
        runner, requests, prefix="", max_steps=2000, on_plan=forward,
        max_num_seqs=8, max_num_batched_tokens=48, num_cpu_blocks=NUM_CPU_BLOCKS, preemption_mode="auto",
    )  # fmt: skip
    metrics = run.scheduler.metrics
    assert metrics.preemptions_total >= 2 and metrics.prefix_cache_hits_total > 0
    return run.tokens


def _rank_main(rank: int, checkpoints: dict[str, Path], init_method: str, out_dir: Path, device: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD_SIZE))
    cfg = _worker_config(
        Path(), device, tensor_parallel_size=WORLD_SIZE, rank=rank, dist_init_method=init_method
    )
    cfg, parallel = init_parallel(
        replace(cfg, model=str(checkpoints["tiny"])), load_model_config(checkpoints["tiny"])
    )
    log = get_logger(process="worker", rank=rank)
    for name, model_dir in checkpoints.items():
        runner = ModelRunner(
            replace(cfg, model=str(model_dir)), cfg.resolved_attention_backend, parallel=parallel
        )
        recorder = Recorder(runner)
        pools = {"num_kv_blocks": runner.num_kv_blocks, "pool_shape": tuple(runner.kv.device_pool.shape)}
        if rank == 0:
            tokens = _run_engine(runner, parallel)
            parallel.forward_to_followers(encode(Shutdown("next checkpoint")))
            result = recorder.result(tokens=tokens, **pools)
        else:
            assert server._follow(runner, parallel, log) == 0
            result = recorder.result(**pools)
        torch.save(result, out_dir / f"{name}-rank{rank}.pt")
        runner.close()
    parallel.close()


def _run_ranks(checkpoints: dict[str, Path], out_dir: Path, device: str = "cpu") -> None:
    """Runs the two ranks (gloo on the CPU; on CUDA, NCCL with one GPU per rank) over every checkpoint."""
    spawn_ranks(_rank_main, (checkpoints, f"tcp://127.0.0.1:{free_port()}", out_dir, device))


def spawn_ranks(rank_main: Callable[..., None], args: tuple, timeout_s: float = TIMEOUT_S) -> None:
    """`rank_main(rank, *args)` in WORLD_SIZE spawned processes; a rank that fails fails the caller with its
    traceback, and ranks still alive after `timeout_s` are killed."""
    context = mp.start_processes(rank_main, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    try:
        for _ in range(int(timeout_s)):
            if context.join(timeout=1):  # raises, with the rank's traceback, if one failed
                return
        raise AssertionError(f"the ranks did not finish within {timeout_s} s")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_two_ranks_match_one_process(name: str, checkpoints, tensor_parallel_runs) -> None:
    check_two_ranks_match_one_process(checkpoints[name], tensor_parallel_runs[name], "cpu")


def check_two_ranks_match_one_process(model_dir: Path, ranks: list[dict[str, Any]], device: str) -> None:
    """The ranks' tokens equal one process's on `device`; their logits agree exactly with each other and
    closely with its. (Logits are recorded where they are computed eagerly: on CUDA, the decode steps run
    in CUDA graphs, which record nothing; their tokens are compared all the same.)"""
    cfg = _worker_config(model_dir, device)
    single = ModelRunner(cfg, cfg.resolved_attention_backend)
    recorder = Recorder(single)
    expected_tokens = _run_engine(single, ParallelContext())
    expected = recorder.result()

    rank0, rank1 = ranks
    config = load_model_config(model_dir)
    assert rank0["num_kv_blocks"] == rank1["num_kv_blocks"] == NUM_KV_BLOCKS
    # [L, 2, num_blocks, Hkv, block_size, D]: each rank holds its KV heads only
    assert rank0["pool_shape"][3] == config.num_kv_heads // WORLD_SIZE
    assert rank0["tokens"] == expected_tokens
    assert rank0["outputs"] == expected["outputs"]
    assert rank1["outputs"] == rank0["outputs"]  # every rank samples the same tokens from the same logits
    assert torch.equal(rank1["logits"], rank0["logits"])
    assert rank0["logits"].shape == expected["logits"].shape
    assert expected["logits"].shape[1] == config.vocab_size
    torch.testing.assert_close(rank0["logits"], expected["logits"], rtol=1e-4, atol=1e-4)


def test_sizes_that_do_not_divide_are_refused_before_the_rendezvous(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's num_heads \(4\)"):
        shard_model_config(config, 3)
    with pytest.raises(ValueError, match=r"must divide the model's num_kv_heads \(2\)"):
        shard_model_config(replace(config, num_heads=8), 4)
    with pytest.raises(ValueError, match="num_heads"):  # no process group is joined: this returns at once
        init_parallel(_worker_config(tiny_model_dir, tensor_parallel_size=3, rank=2), config)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        init_parallel(_worker_config(tiny_model_dir, tensor_parallel_size=2, rank=2), config)
    assert not torch.distributed.is_initialized()


def test_size_one_is_the_plain_model(tiny_model_dir: Path) -> None:
    cfg = _worker_config(tiny_model_dir)
    same_cfg, parallel = init_parallel(cfg, load_model_config(tiny_model_dir))
    assert same_cfg is cfg and parallel.world_size == 1 and parallel.group is None
    assert not torch.distributed.is_initialized()
    weight = torch.randn(10, 3)
    ids = torch.tensor([0, 9, 4])
    assert torch.equal(vocab_parallel_embedding(ids, weight, parallel), weight[ids])
    hidden = torch.randn(2, 3)
    assert torch.equal(vocab_parallel_logits(hidden, weight, 10, parallel), hidden @ weight.T)
    assert parallel.min_across_ranks(7) == 7
    parallel.forward_to_followers([b"x", b""])  # nothing to send to
    parallel.keep_followers_alive()


def test_honcho_process_names_give_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HONCHO_PROCESS_NAME", raising=False)
    assert honcho_rank() is None
    monkeypatch.setenv("HONCHO_PROCESS_NAME", "worker.1")
    assert honcho_rank() == 0
    monkeypatch.setenv("HONCHO_PROCESS_NAME", "worker.2")
    assert honcho_rank() == 1
