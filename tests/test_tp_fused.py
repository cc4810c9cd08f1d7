"""The fused all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py) and the no-copy row-parallel
path (worker/tp_fused.py) on the CPU, under TRITON_INTERPRET=1.

The kernel's math against its PyTorch reference, with the peers' symmetric buffers and signal pads as
ordinary tensors (the peers' signals set beforehand, as if they had arrived); and the whole path through the
model: two ranks over gloo whose stand-in for the symmetric buffer gathers the partial sums and hands them to
the same kernel give the single process's tokens (tests/test_tensor_parallel.py's check). On two GPUs:
tests/test_tensor_parallel_gpu.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagedserve.kernels.all_reduce_norm import all_reduce_add_rms_norm, all_reduce_add_rms_norm_reference
from pagedserve.kernels.reference_ops import rms_norm
from pagedserve.worker.tp_fused import SymmMemRowParallel
from tests.test_tensor_parallel import checkpoints  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel on the CPU needs TRITON_INTERPRET=1"
)


def run_kernel_as_rank(
    partials: list[torch.Tensor],  # every rank's partial sums [R, N], in rank order
    rank: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel as rank `rank` runs it, with every peer's signals for both barriers already arrived.
    Checks the signal protocol's end state: this rank's pad all zeros again, one signal left in each peer's
    pad per barrier channel (for the peer's kernel to consume)."""
    world = len(partials)
    rows = partials[0].shape[0]
    programs = min(rows, num_programs)
    buffers = [torch.cat([p.flatten(), torch.zeros(3, dtype=p.dtype)]) for p in partials]  # padded
    pads = [torch.zeros(4 * programs * world + 8, dtype=torch.int32) for _ in range(world)]
    for channel in range(2 * programs):
        for peer in range(world):
            if peer != rank:
                pads[rank][channel * world + peer] = 1
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    out = all_reduce_add_rms_norm(buffer_ptrs, pad_ptrs, rank, residual, weight, eps, num_programs)
    assert not pads[rank].any()
    for peer in range(world):
        if peer != rank:
            slots = pads[peer][: 2 * programs * world].view(2 * programs, world)
            assert slots[:, rank].eq(1).all() and slots.sum() == 2 * programs
    return out


@pytest.mark.parametrize(
    ("dtype", "world", "rows", "hidden", "num_programs"),
    [
        (torch.bfloat16, 2, 5, 96, 3),  # rows > programs: a program loops over rows; hidden not a power of 2
        (torch.bfloat16, 2, 1, 128, 128),
        (torch.float32, 2, 7, 64, 4),
        (torch.bfloat16, 4, 6, 80, 4),
    ],
)
def test_kernel_matches_the_pytorch_reference_on_every_rank(
    dtype: torch.dtype, world: int, rows: int, hidden: int, num_programs: int
) -> None:
    gen = torch.Generator().manual_seed(rows * hidden + world)
    partials = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    ref_out, ref_res = all_reduce_add_rms_norm_reference(partials, residual.clone(), weight, 1e-5)
    results = []
    for rank in range(world):
        res = residual.clone()
        out, new_res = run_kernel_as_rank(partials, rank, res, weight, 1e-5, num_programs)
        assert new_res is res  # written in place
        results.append((out, new_res))
        if world == 2:  # one addition rounded once: exactly NCCL's sum of two, then the add and norm
            torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        else:
            torch.testing.assert_close(new_res, ref_res, rtol=1e-2, atol=1e-2)
        tol = {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(out, ref_out, **tol)
    for out, res in results[1:]:  # every rank gets the same bits: the ranks' residual streams stay equal
        assert torch.equal(out, results[0][0]) and torch.equal(res, results[0][1])


def test_reference_is_nccl_sum_then_add_and_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, residual = (torch.randn(3, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    weight = torch.ones(32, dtype=torch.bfloat16)
    out, res = all_reduce_add_rms_norm_reference([a, b], residual.clone(), weight, 1e-6)
    expected_out, expected_res = rms_norm(a + b, weight, 1e-6, residual.clone())  # bf16 a + b: rounded once
    assert torch.equal(res, expected_res) and torch.equal(out, expected_out)


# ---------------------------------------------------------------------------------------------------------
# The path through the model on two gloo ranks


class GlooRowParallel(SymmMemRowParallel):
    """SymmMemRowParallel with an ordinary CPU buffer: the reduces gather every rank's partial sums over gloo
    and run the same reduce (the fused kernel on them as `run_kernel_as_rank` does, or the plain sum)."""

    def __init__(self, rank: int, world_size: int, fuse_norm: bool) -> None:  # noqa: D107 (no rendezvous)
        self.rank, self.world_size, self.fuse_norm = rank, world_size, fuse_norm
        self.max_bytes = 1 << 20
        self.buffer = torch.empty(self.max_bytes, dtype=torch.uint8)
        self.num_programs = 3
        self.pending = None
        self.num_calls = 0

    def _gather(self, partial: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(partial) for _ in range(self.world_size)]
        dist.all_gather(parts, partial.contiguous())
        return parts

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        assert self.is_pending(partial)
        self.pending, self.num_calls = None, self.num_calls + 1
        return torch.stack([p.float() for p in self._gather(partial)]).sum(0).to(partial.dtype)

    def reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.is_pending(partial) and residual.is_contiguous()
        self.pending, self.num_calls = None, self.num_calls + 1
        parts = self._gather(partial)
        return run_kernel_as_rank(parts, self.rank, residual, weight, eps, self.num_programs)


def _fused_rank_main(rank: int, models: dict[str, Path], init_method: str, out_dir: Path, mode: str) -> None:
    from pagedserve.worker import parallel as worker_parallel
    from tests import test_tensor_parallel

    made: list[GlooRowParallel] = []

    def make(group: Any, control: Any, device: torch.device, world_size: int, _: str) -> tuple[Any, str]:
        made.append(GlooRowParallel(rank, world_size, fuse_norm=mode == "fused"))
        return made[-1], ""

    worker_parallel.make_row_parallel = make  # this spawned process's only
    test_tensor_parallel._rank_main(rank, models, init_method, out_dir, "cpu")
    (out_dir / f"calls-rank{rank}.txt").write_text(str(made[0].num_calls))


@pytest.mark.parametrize(
    ("mode", "names"),
    [
        # Llama, and biases on every projection (rank 0 adds the row-parallel ones into its partial sum)
        ("fused", ("tiny", "odd-vocab-biases")),
        ("no-copy", ("tiny",)),
    ],
)
def test_two_ranks_with_the_fused_path_match_one_process(
    mode: str,
    names: tuple[str, ...],
    checkpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    from scripts._servers import free_port
    from tests.test_tensor_parallel import (
        TIMEOUT_S,
        WORLD_SIZE,
        check_two_ranks_match_one_process,
        spawn_ranks,
    )

    chosen = {name: checkpoints[name] for name in names}
    spawn_ranks(_fused_rank_main, (chosen, f"tcp://127.0.0.1:{free_port()}", tmp_path, mode), 2 * TIMEOUT_S)
    for name, model_dir in chosen.items():
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(WORLD_SIZE)]
        check_two_ranks_match_one_process(model_dir, ranks, "cpu")
    calls = [int((tmp_path / f"calls-rank{r}.txt").read_text()) for r in range(WORLD_SIZE)]
    assert calls[0] == calls[1] > 0  # every o_proj and down_proj of every step took the path
