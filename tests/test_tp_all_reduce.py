"""Tensor parallelism's all-reduce paths on the CPU: which messages take the one-shot symmetric-memory
kernel (worker/tp_all_reduce.py) and which NCCL/gloo, the pool-following batch limit (worker/batch_limits.py)
and the TP step profile script. The kernel itself needs two GPUs: tests/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pagedserve.common.config import SchedulerConfig, WorkerConfig
from pagedserve.common.messages import WorkerReady
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.worker.batch_limits import MAX_AUTO, MIN_AUTO, auto_max_num_seqs, resolve_max_num_seqs
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.tp_all_reduce import DEFAULT_MAX_BYTES, SymmMemAllReduce, symm_mem_supported
from scripts.bench_tp_step import main as bench_tp_step


class _StandIn:
    """What ParallelContext asks of the one-shot path: fits() and a call that sums in place (here: x2)."""

    max_bytes = DEFAULT_MAX_BYTES
    plan: list[tuple[int, str]] = []  # not tuned: one-shot up to max_bytes
    fits = SymmMemAllReduce.fits
    method = SymmMemAllReduce.method

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2)


def test_small_messages_take_the_one_shot_path_and_large_ones_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ParallelContext(rank=0, world_size=2)
    ctx.fast_all_reduce = fast = _StandIn()
    nccl: list[int] = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: nccl.append(x.numel()) or x.mul_(3))
    ctx.all_reduce_trace = []
    small = torch.ones(256, 4096, dtype=torch.bfloat16)  # a decode step's message: 2 MiB
    assert ctx.all_reduce(small) is small and bool((small == 2).all())
    large = torch.ones(DEFAULT_MAX_BYTES // 2 + 2, dtype=torch.bfloat16)  # one element over the buffer
    assert bool((ctx.all_reduce(large) == 3).all())
    odd = torch.ones(8, dtype=torch.float16)  # a dtype the one-shot kernel is not built for
    strided = torch.ones(8, 4)[:, :2]  # not contiguous: the copy into the buffer would reorder it
    ctx.all_reduce(odd), ctx.all_reduce(strided)
    assert fast.calls == 1 and nccl == [large.numel(), 8, 16]
    assert ctx.all_reduce_trace == [
        (256 * 4096 * 2, "symm_mem"), (large.numel() * 2, "nccl"), (16, "nccl"), (64, "nccl")
    ]  # fmt: skip
    ctx.fast_all_reduce = None  # --tp-all-reduce nccl
    ctx.all_reduce(small)
    assert fast.calls == 1 and len(nccl) == 4


def test_size_one_touches_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ParallelContext()
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective at size 1"))
    x = torch.ones(3)
    assert ctx.all_reduce(x) is x and bool((x == 1).all())


def test_a_tuned_plan_routes_each_size_to_the_fastest_kernel_measured() -> None:
    comm = _StandIn()
    assert comm.method(1 << 20) == "one-shot" and comm.method(DEFAULT_MAX_BYTES + 1) == "nccl"  # untuned
    comm.plan = [(1 << 20, "one-shot"), (16 << 20, "nccl"), (64 << 20, "two-shot")]
    assert [comm.method(n) for n in (1, 1 << 20, (1 << 20) + 1, 16 << 20, 32 << 20, 64 << 20)] == [
        "one-shot", "one-shot", "nccl", "nccl", "two-shot", "two-shot"
    ]  # fmt: skip
    assert comm.method((64 << 20) + 1) == "nccl"  # past the two-shot buffer
    assert comm.fits(torch.empty(16 << 20, dtype=torch.bfloat16))  # 32 MiB: two-shot
    assert not comm.fits(torch.empty(4 << 20, dtype=torch.bfloat16))  # 8 MiB: NCCL measured faster


def test_symm_mem_needs_cuda() -> None:
    assert symm_mem_supported(torch.device("cpu"), 2) == "not on CUDA"


def test_the_default_batch_limit_follows_the_pool() -> None:
    # the 8B shape's pools (docs/benchmarks.md): one H200 55,177 blocks, two 117,169 (16 tokens each)
    assert auto_max_num_seqs(55_177, 16) == 832
    assert auto_max_num_seqs(117_169, 16) == MAX_AUTO == 1024
    assert auto_max_num_seqs(100, 16) == MIN_AUTO == 512  # a small pool: the old fixed default
    assert auto_max_num_seqs(40_000, 16) == 576  # steps of 64
    assert resolve_max_num_seqs(24, 117_169, 16) == 24  # set: as set
    with pytest.raises(ValueError, match="at least 0"):
        resolve_max_num_seqs(-1, 100, 16)
    assert WorkerConfig().max_num_seqs == 0 and SchedulerConfig().max_num_seqs == 0


def _ready(max_num_seqs: int) -> WorkerReady:
    return WorkerReady(1000, 16, 1024, 100, [2], "/m", "m", max_num_seqs=max_num_seqs)


def test_the_scheduler_takes_the_workers_batch_limit_by_default() -> None:
    assert SchedulerSettings.from_config(SchedulerConfig(), _ready(1024)).max_num_seqs == 1024
    assert SchedulerSettings.from_config(SchedulerConfig(max_num_seqs=300), _ready(1024)).max_num_seqs == 300
    assert SchedulerSettings.from_config(SchedulerConfig(), _ready(0)).max_num_seqs == 512  # an old worker


def test_the_runner_announces_the_pools_batch_limit(tiny_model_dir: Path) -> None:
    from pagedserve.worker.model_runner import ModelRunner

    cfg = WorkerConfig(
        model=str(tiny_model_dir), device="cpu", num_kv_blocks=40_000, block_size=16, swap_space=0
    )
    runner = ModelRunner(cfg)
    assert runner.max_num_seqs == auto_max_num_seqs(40_000, 16) == 576
    runner.close()


def test_tp_step_profile_runs_every_variant_on_two_gloo_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "2,3", "--context", "12"]
    argv += ["--steps", "2", "--max-num-batched-tokens", "64", "--json-out", str(out)]
    assert bench_tp_step(argv) == 0
    result = json.loads(out.read_text())
    rows = result["steps"]
    variants = ["nccl", "one-shot", "no-copy", "fused"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for b in (2, 3) for v in variants]
    assert all(r["skipped"] == "not on CUDA" for r in rows if r["variant"] != "nccl")
    assert result["all_reduce_sizes"] == [{"error": "not on CUDA"}]
    rows = [r for r in rows if r["variant"] == "nccl"]
    for r in rows:
        assert r["tensor_parallel_size"] == 2 and r["mode"] == "eager" and r["step_wall_ms"] > 0
