"""Tensor parallelism on two GPUs: NCCL between the ranks, the Triton kernels, CUDA graphs for decode steps
(with the all-reduces captured in them). The same plans and checks as the CPU test over gloo
(test_tensor_parallel.py). Skipped without two CUDA devices; run on the device machine with
`pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scripts._servers import free_port
from tests.test_tensor_parallel import (
    CHECKPOINTS,
    ON_GPUS,
    WORLD_SIZE,
    _run_ranks,
    check_two_ranks_match_one_process,
    checkpoints,  # noqa: F401 (a fixture)
    spawn_ranks,
)

pytestmark = ON_GPUS


@pytest.fixture(scope="module")
def gpu_tensor_parallel_runs(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[dict[str, Any]]]:
    out_dir = tmp_path_factory.mktemp("tensor-parallel-gpu")
    _run_ranks(checkpoints, out_dir, device="cuda")
    return {
        name: [torch.load(out_dir / f"{name}-rank{rank}.pt") for rank in range(WORLD_SIZE)]
        for name in checkpoints
    }


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_two_gpus_match_one_gpu(name: str, checkpoints, gpu_tensor_parallel_runs) -> None:  # noqa: F811
    check_two_ranks_match_one_process(checkpoints[name], gpu_tensor_parallel_runs[name], "cuda")


# ---------------------------------------------------------------------------------------------------------
# The one-shot symmetric-memory all-reduce (worker/tp_all_reduce.py) and the fused add + RMSNorm after it,
# against NCCL's all_reduce and the PyTorch add + RMSNorm (kernels/reference_ops.py).

# [rows, hidden] in bf16: one token, an odd batch, decode at 256 and 512, the buffer's limit (16 MiB) and
# one past it (NCCL), and float32 (the tests' models)
_SHAPES = [(1, 4096), (7, 4096), (256, 4096), (512, 4096), (2048, 4096), (2049, 4096)]


def _symm_rank_main(rank: int, init_method: str) -> None:
    import torch.distributed as dist

    from pagedserve.kernels import fused_ops, reference_ops
    from pagedserve.worker.parallel import ParallelContext
    from pagedserve.worker.tp_all_reduce import LARGE_MAX_BYTES, TUNE_SIZES, make_symm_mem_all_reduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    control = dist.new_group(backend="gloo")
    # untuned: one-shot up to the buffer, NCCL past it (the tuned routing is checked at the end)
    fast, why = make_symm_mem_all_reduce(dist.group.WORLD, control, device, WORLD_SIZE, "auto", tune=False)
    assert fast is not None, why
    ctx = ParallelContext(rank, WORLD_SIZE, dist.group.WORLD, control)
    ctx.fast_all_reduce = fast
    eps = 1e-5
    for dtype, shapes in ((torch.bfloat16, _SHAPES), (torch.float32, _SHAPES[:3])):
        for rows, hidden in shapes:
            gen = torch.Generator(device).manual_seed(1000 * rows + rank)  # each rank's own partial sum
            partial = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
            gen.manual_seed(rows)  # the residual stream and the weight: the same on every rank
            residual = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
            weight = 1 + 0.1 * torch.randn(hidden, generator=gen, device=device, dtype=dtype)
            reference = partial.clone()
            dist.all_reduce(reference)  # NCCL
            ref_out, ref_res = reference_ops.rms_norm(reference, weight, eps, residual.clone())
            ctx.all_reduce_trace = []
            summed = ctx.all_reduce(partial.clone())
            path = ctx.all_reduce_trace[0][1]
            big = rows * hidden * partial.element_size() > fast.max_bytes
            assert path == ("nccl" if big or dtype not in (torch.bfloat16, torch.float32) else "symm_mem")
            # two ranks: one addition, rounded once, whichever kernel does it; bf16 allows a unit in the
            # last place should a kernel add in bf16 pairs rather than in float32
            exact = {"rtol": 8e-3, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(summed, reference, **exact)
            out, res = fused_ops.rms_norm(summed, weight, eps, residual.clone())
            torch.testing.assert_close(res, ref_res, **exact)
            tol = {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
            torch.testing.assert_close(out, ref_out, **tol)
    # Captured in a CUDA graph and replayed on new inputs, as a decode graph does.
    static = torch.zeros(256, 4096, device=device, dtype=torch.bfloat16)
    ctx.all_reduce(static.clone())  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.all_reduce(static)
    for step in range(3):
        static.fill_(float(rank + 1 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert bool((static == 3 + 2 * step).all()), f"replay {step}: {static.flatten()[:4]}"
    del graph
    # Tuned: every size measured on both ranks gets one path, the same on every rank; and the two-shot
    # kernel (prefill chunks: 4096 and 8192 tokens x 4096) sums as NCCL does
    rows = fast.tune(dist.group.WORLD, control)
    assert [r["bytes"] for r in rows] == list(TUNE_SIZES) and all(r["best"] in _PATHS for r in rows)
    plans = [None] * WORLD_SIZE
    dist.all_gather_object(plans, fast.plan, group=control)
    assert plans[0] == plans[1] == [(r["bytes"], r["best"]) for r in rows]
    two_shot = [(LARGE_MAX_BYTES, "two-shot")] if fast.large_buffer is not None else []
    for forced in ([two_shot] if two_shot else []) + [fast.plan]:
        fast.plan = forced
        for tokens in (4096, 8192, 1000):
            gen = torch.Generator(device).manual_seed(tokens + rank)
            partial = torch.randn(tokens, 4096, generator=gen, device=device, dtype=torch.bfloat16)
            reference = partial.clone()
            dist.all_reduce(reference)
            torch.testing.assert_close(ctx.all_reduce(partial), reference, rtol=8e-3, atol=1e-5)
    dist.barrier(group=control)
    dist.destroy_process_group()


_PATHS = ("nccl", "one-shot", "two-shot")


def test_one_shot_all_reduce_and_fused_norm_match_nccl_and_pytorch() -> None:
    spawn_ranks(_symm_rank_main, (f"tcp://127.0.0.1:{free_port()}",), 180)


# ---------------------------------------------------------------------------------------------------------
# The no-copy and fused paths (worker/tp_fused.py, kernels/all_reduce_norm.py): the row-parallel matmul into
# symmetric memory, then the sum over the ranks (with the residual add + RMSNorm when fused), against
# F.linear + NCCL's all_reduce + the PyTorch add + RMSNorm, on fresh random inputs, eagerly and in a CUDA
# graph.

# (rows, in features per rank, hidden): one token, odd batches, decode at 256 and 512, the buffer's limit
# (2048 x 4096 bf16 = 16 MiB) and one past it (the plain path), a hidden size not a power of 2
_MATMUL_SHAPES = [
    (1, 2048, 4096), (7, 2048, 4096), (256, 2048, 4096), (512, 7168, 4096), (2048, 512, 4096),
    (2049, 512, 4096), (33, 1536, 5120),
]  # fmt: skip


def _fused_rank_main(rank: int, init_method: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from pagedserve.kernels import reference_ops
    from pagedserve.worker.models.fp8_linear import row_parallel_partial
    from pagedserve.worker.models.layers import RMSNorm, add_norm
    from pagedserve.worker.parallel import ParallelContext
    from pagedserve.worker.tp_fused import make_row_parallel

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    control = dist.new_group(backend="gloo")
    eps = 1e-5
    for mode in ("fused", "no-copy"):
        rp, why = make_row_parallel(dist.group.WORLD, control, device, WORLD_SIZE, mode)
        assert rp is not None, why
        ctx = ParallelContext(rank, WORLD_SIZE, dist.group.WORLD, control)
        ctx.row_parallel = rp
        for dtype in (torch.bfloat16, torch.float32):
            for rows, cols, hidden in _MATMUL_SHAPES if dtype == torch.bfloat16 else _MATMUL_SHAPES[:3]:
                gen = torch.Generator(device).manual_seed(1000 * rows + rank)  # this rank's own shard
                x = torch.randn(rows, cols, generator=gen, device=device, dtype=dtype)
                proj = torch.nn.Module()
                proj.weight = torch.randn(hidden, cols, generator=gen, device=device, dtype=dtype) / cols**0.5
                gen.manual_seed(rows)  # the bias, residual stream and norm weight: the same on every rank
                proj.bias = torch.randn(hidden, generator=gen, device=device, dtype=dtype)
                residual = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
                norm = RMSNorm(hidden, eps, dtype, device, fused=True)
                norm.weight.data.copy_(
                    1 + 0.1 * torch.randn(hidden, generator=gen, device=device, dtype=dtype)
                )
                reference = F.linear(x, proj.weight, proj.bias if rank == 0 else None)
                dist.all_reduce(reference)  # NCCL
                ref_out, ref_res = reference_ops.rms_norm(reference, norm.weight, eps, residual.clone())
                ctx.all_reduce_trace = []
                calls = rp.num_calls
                partial = row_parallel_partial(x, proj, ctx)
                out, res = add_norm(partial, residual.clone(), norm, ctx)
                taken = rows * hidden * x.element_size() <= rp.max_bytes
                assert (rp.num_calls == calls + 1) == taken, (mode, rows, hidden)
                # past the buffer, the plain all-reduce (NCCL at that size) records its own path
                nbytes = rows * hidden * x.element_size()
                assert ctx.all_reduce_trace == [(nbytes, mode if taken else "nccl")], ctx.all_reduce_trace
                exact = (
                    {"rtol": 8e-3, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
                )
                torch.testing.assert_close(res, ref_res, **exact)
                tol = (
                    {"rtol": 1.6e-2, "atol": 2e-2}
                    if dtype == torch.bfloat16
                    else {"rtol": 1e-5, "atol": 1e-5}
                )
                torch.testing.assert_close(out, ref_out, **tol)
                gathered = [torch.empty_like(res) for _ in range(WORLD_SIZE)]
                dist.all_gather(gathered, res)
                assert torch.equal(gathered[0], gathered[1])  # the ranks' residual streams stay identical
        # Captured in a CUDA graph (matmul into the buffer, reduce + add + norm) and replayed on new inputs
        rows, cols, hidden = 256, 2048, 4096
        dt = torch.bfloat16
        proj = torch.nn.Module()
        proj.weight = torch.randn(hidden, cols, device=device, dtype=dt) / cols**0.5
        proj.bias = None
        norm = RMSNorm(hidden, eps, dt, device, fused=True)
        norm.weight.data.fill_(1.0)
        x = torch.zeros(rows, cols, device=device, dtype=dt)
        residual = torch.zeros(rows, hidden, device=device, dtype=dt)
        add_norm(row_parallel_partial(x, proj, ctx), residual, norm, ctx)  # warm-up (the Triton compile)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_res = add_norm(row_parallel_partial(x, proj, ctx), residual, norm, ctx)
        for step in range(3):
            gen = torch.Generator(device).manual_seed(10 * step + rank)
            x.copy_(torch.randn(rows, cols, generator=gen, device=device, dtype=dt))
            gen.manual_seed(10 * step)
            residual.copy_(torch.randn(rows, hidden, generator=gen, device=device, dtype=dt))
            reference = F.linear(x, proj.weight)
            dist.all_reduce(reference)
            ref_out, ref_res = reference_ops.rms_norm(reference, norm.weight, eps, residual.clone())
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_res, ref_res, rtol=8e-3, atol=1e-5)
            torch.testing.assert_close(static_out, ref_out, rtol=1.6e-2, atol=2e-2)
        del graph
        ctx.row_parallel = None
        dist.barrier(group=control)
    dist.destroy_process_group()


def test_no_copy_and_fused_all_reduce_match_nccl_and_pytorch() -> None:
    spawn_ranks(_fused_rank_main, (f"tcp://127.0.0.1:{free_port()}",), 180)
