"""The row-parallel matmuls' partial sums written straight into symmetric memory, and reduced from there.

worker/tp_all_reduce.py's one-shot path copies each message into its symmetric buffer first (a kernel per
all-reduce, 0.22 ms of a 10 ms 8B decode step at TP=2). Here the matmuls whose outputs are summed over the
ranks (o_proj, down_proj: `row_parallel_partial` in worker/models/fp8_linear.py) write their partial sums into
this rank's symmetric buffer themselves (`torch.mm(..., out=view)`), and the sum is taken from there:

  no-copy  torch's one-shot kernel (`symm_mem.one_shot_all_reduce_out`) into a new tensor, then the
           residual add + RMSNorm as before;
  fused    one Triton kernel (kernels/all_reduce_norm.py) reads the peers' partial sums, adds them and the
           residual, and writes the new residual and the normed rows (`add_norm` in worker/models/layers.py).

Between the matmul and the reduce the partial sum is "pending": `pending` holds the view, and only the
norm that follows (which checks for it by identity) consumes it, so nothing else can read a partial sum
as if it were the whole. One buffer serves every layer: each reduce ends with a barrier, after which no
peer reads it any more, so the next matmul may overwrite it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pagedserve.worker.tp_all_reduce import DEFAULT_MAX_BYTES, all_ranks_ok, symm_mem_supported

_DTYPES = (torch.bfloat16, torch.float32)


class SymmMemRowParallel:
    """This rank's symmetric buffer for the row-parallel matmuls' partial sums, and the reduces from it.
    Construct it on every rank at once (the rendezvous is a collective)."""

    def __init__(
        self, group: Any, device: torch.device, fuse_norm: bool, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from pagedserve.kernels.all_reduce_norm import MAX_PROGRAMS, signal_channels_needed

        self.group_name: str = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            enable(self.group_name)
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.handle = handle
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # Every rank's buffer as this process maps it (the tensor may start past its allocation's base)
        shift = self.buffer.data_ptr() - int(handle.buffer_ptrs[self.rank])
        ptrs = [int(p) + shift for p in handle.buffer_ptrs]
        self.buffer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)  # [W]
        pads = [int(p) for p in handle.signal_pad_ptrs]
        self.signal_pad_ptrs = torch.tensor(pads, dtype=torch.int64, device=device)  # [W]
        # Programs of the fused kernel: under the SM count (each spins on a barrier with its peers' twin,
        # so all must be resident at once) and within the signal pad's channels
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        pad_bytes = getattr(handle, "signal_pad_size", None) or symm_mem.get_signal_pad_size()
        channels = int(pad_bytes) // (4 * self.world_size)
        self.num_programs = max(1, min(MAX_PROGRAMS, sms - 4, channels // 2))
        assert signal_channels_needed(self.num_programs) <= channels
        self.fuse_norm = fuse_norm
        self.pending: torch.Tensor | None = None  # the partial sum a matmul wrote, until it is reduced
        self.num_calls = 0  # reduces taken by this path (eager calls and graph captures; not replays)

    @property
    def mode(self) -> str:
        return "fused" if self.fuse_norm else "no-copy"

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x @ weight.T can be written into the buffer: 2-D, one dtype we reduce, and it fits."""
        return (
            x.dim() == 2
            and x.dtype in _DTYPES
            and weight.dtype == x.dtype
            and x.shape[0] * weight.shape[0] * x.element_size() <= self.max_bytes
        )

    def matmul(
        self,
        x: torch.Tensor,  # [T, K / N]
        weight: torch.Tensor,  # [H, K / N]
        bias: torch.Tensor | None,  # [H]: rank 0's only
    ) -> torch.Tensor:  # [T, H], this rank's partial sum, in the buffer: pending
        rows, cols = x.shape[0], weight.shape[0]
        out = self.buffer[: rows * cols * x.element_size()].view(x.dtype).view(rows, cols)
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)
        self.pending = out
        return out

    def is_pending(self, x: torch.Tensor) -> bool:
        return self.pending is not None and x is self.pending

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of the pending partial sums, in a new tensor (torch's one-shot kernel)."""
        assert self.is_pending(partial)
        self.pending = None
        self.num_calls += 1
        out = torch.empty_like(partial)
        return torch.ops.symm_mem.one_shot_all_reduce_out(partial, "sum", self.group_name, out)

    def reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of (the sum over the ranks of the pending partial sums) + `residual`, and that sum, written
        into `residual` (contiguous, [T, H]): kernels/all_reduce_norm.py."""
        from pagedserve.kernels.all_reduce_norm import all_reduce_add_rms_norm

        assert self.is_pending(partial) and residual.shape == partial.shape
        self.pending = None
        self.num_calls += 1
        return all_reduce_add_rms_norm(
            self.buffer_ptrs, self.signal_pad_ptrs, self.rank, residual, weight, eps, self.num_programs
        )


def _probe(comm: SymmMemRowParallel, device: torch.device) -> str:
    """Runs both reduces once on known values; why they are wrong, or ""."""
    from pagedserve.kernels.all_reduce_norm import all_reduce_add_rms_norm_reference

    rows, hidden, world, rank = 5, 1024, comm.world_size, comm.rank
    x = torch.eye(hidden, dtype=torch.bfloat16, device=device)[:rows]
    w = torch.full((hidden, hidden), 0.0, dtype=torch.bfloat16, device=device)
    w.fill_diagonal_(float(rank + 1))  # x @ w.T: rank + 1 on the diagonal
    expected = x * (world * (world + 1) / 2)
    summed = comm.reduce(comm.matmul(x, w, None))
    if not torch.equal(summed, expected):
        return "the no-copy all-reduce's probe came out wrong"
    if comm.fuse_norm:
        residual = torch.ones(rows, hidden, dtype=torch.bfloat16, device=device)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        partials = [x * (r + 1) for r in range(world)]
        ref_out, ref_res = all_reduce_add_rms_norm_reference(partials, residual.clone(), weight, 1e-5)
        out, res = comm.reduce_add_rms_norm(comm.matmul(x, w, None), residual, weight, 1e-5)
        if not (torch.equal(res, ref_res) and torch.allclose(out.float(), ref_out.float(), atol=2e-2)):
            return "the fused all-reduce + RMSNorm's probe came out wrong"
    torch.cuda.synchronize(device)
    return ""


def make_row_parallel(
    group: Any, control_group: Any, device: torch.device, world_size: int, mode: str
) -> tuple[SymmMemRowParallel | None, str]:
    """The no-copy (`mode` "no-copy") or fused ("fused", "auto") path for `group`, or None and why not;
    decided by every rank together and probed once, as worker/tp_all_reduce.py's one-shot path is."""
    if mode not in ("no-copy", "fused", "auto"):
        why = f"--tp-all-reduce {mode}"
    else:
        why = symm_mem_supported(device, world_size)
    if not all_ranks_ok(why, control_group):
        return None, why or "another rank cannot use symmetric memory"
    comm: SymmMemRowParallel | None = None
    try:
        comm = SymmMemRowParallel(group, device, fuse_norm=mode != "no-copy")
        why = _probe(comm, device)
    except Exception as e:  # noqa: BLE001 (an API this torch lacks, the Triton compile, the rendezvous)
        why = f"{type(e).__name__}: {e}"
    if not all_ranks_ok(why, control_group):
        return None, why or "the no-copy/fused all-reduce failed on another rank"
    assert comm is not None
    comm.num_calls = 0
    return comm, ""
