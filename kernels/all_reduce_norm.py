"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm after it, in one Triton kernel.

Each rank's row-parallel matmul (o_proj, down_proj) has written its partial sums [R, N] at the start of its
symmetric buffer (torch.distributed._symmetric_memory: every rank's buffer is mapped into every process, and
beside each buffer a pad of uint32 signal slots). One launch then, per program:
  1. a barrier with the same program on every peer, over the signal pads: after it, every rank's partial
     sums are written (the matmul before it on each stream has finished);
  2. for each of its rows: the partial sums of every rank, read straight from the peers' memory over
     NVLink and added in rank order in float32 (every rank gets the same bits, so the ranks' residual
     streams stay identical), rounded to the model dtype as NCCL's sum of two is; plus the residual
     (rounded as the model dtype's add is), written back as the new residual; its RMSNorm, as
     kernels/fused_ops.py's `_rms_norm_kernel` computes it, written to `out`;
  3. a second barrier, so that no rank overwrites its buffer (the next matmul) while a peer still reads it.

The signal protocol is the one torch's own symmetric-memory kernels use: a rank sets its slot in the peer's
pad from 0 to 1 (release) and waits for the peer's slot in its own pad to go from 1 back to 0 (acquire), so
the pads are all zero again after every barrier. Program p uses channel p for the first barrier and channel
`num_programs + p` for the second; the grid is kept under the GPU's SM count so that every program is
resident at once (a program spinning on a barrier never waits for a program that cannot be scheduled).

The PyTorch reference (`all_reduce_add_rms_norm_reference`) takes the ranks' partial sums as a list.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import reference_ops
from pagedserve.kernels.fused_ops import _round

MAX_PROGRAMS = 128  # below an H100's 132 SMs: every program resident at once (see above)


def signal_channels_needed(rows: int) -> int:
    """Signal channels (slots of world_size uint32 each) one launch over `rows` rows uses."""
    return 2 * min(rows, MAX_PROGRAMS)


@triton.jit
def _signal_barrier(
    signal_pad_ptrs,  # [W] int64: each rank's signal pad (uint32 slots, W per channel)
    channel,
    rank,
    WORLD: tl.constexpr,
):
    """Every rank's program on `channel` has arrived; then this program's slots are all zero again."""
    for peer in tl.static_range(WORLD):
        pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.uint32))
        slot = pad + channel * WORLD + rank
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = tl.load(signal_pad_ptrs + rank).to(tl.pointer_type(tl.uint32))
    for peer in tl.static_range(WORLD):
        slot = own + channel * WORLD + peer
        while tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys") != 1:
            pass


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    out_ptr,  # [R, N]: the normed rows
    residual_ptr,  # [R, N]: read and overwritten with the reduced sums + residual
    weight_ptr,  # [N]
    buffer_ptrs,  # [W] int64: each rank's symmetric buffer, its partial sums [R, N] (row stride N) first
    signal_pad_ptrs,  # [W] int64: each rank's signal pad
    rank,
    R,
    N,
    eps,
    stride_o,
    stride_r,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of 2 of N
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dt = residual_ptr.dtype.element_ty
    _signal_barrier(signal_pad_ptrs, pid, rank, WORLD)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    for row in range(pid, R, programs):
        row64 = tl.cast(row, tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):
            # 16-byte aligned buffers: vector loads (a pointer read from memory has no known alignment)
            part = tl.multiple_of(tl.load(buffer_ptrs + peer).to(tl.pointer_type(dt)), 16)
            acc += tl.load(part + row64 * N + offs, mask=ok, other=0.0, volatile=True).to(tl.float32)
        r = tl.load(residual_ptr + row64 * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        x = _round(_round(acc, dt) + r, dt)
        tl.store(residual_ptr + row64 * stride_r + offs, x.to(dt), mask=ok)
        normed = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps))
        y = _round(w * _round(normed, dt), out_ptr.dtype.element_ty)
        tl.store(out_ptr + row64 * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # every thread's reads of the peers' buffers are done before the signal
    _signal_barrier(signal_pad_ptrs, programs + pid, rank, WORLD)


def all_reduce_add_rms_norm(
    buffer_ptrs: torch.Tensor,  # [W] int64, on the device: every rank's symmetric buffer
    signal_pad_ptrs: torch.Tensor,  # [W] int64, on the device: every rank's signal pad
    rank: int,
    residual: torch.Tensor,  # [R, N], contiguous: overwritten with the sum + residual
    weight: torch.Tensor,  # [N]
    eps: float,
    num_programs: int = MAX_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor]:  # the normed rows [R, N] and `residual`
    """RMSNorm of (the sum over the ranks of their partial sums [R, N] at the start of their symmetric
    buffers) + `residual`, which is overwritten with that sum. Every rank of the group must launch it
    with the same R (it waits for them)."""
    world = buffer_ptrs.numel()
    rows, n = residual.shape
    assert residual.is_contiguous() and weight.shape == (n,) and world == signal_pad_ptrs.numel()
    out = torch.empty_like(residual)
    if rows:
        block = triton.next_power_of_2(n)
        _all_reduce_add_rms_norm_kernel[(min(rows, num_programs, MAX_PROGRAMS),)](
            out, residual, weight, buffer_ptrs, signal_pad_ptrs, rank, rows, n, eps,
            out.stride(0), residual.stride(0),
            WORLD=world, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out, residual


def all_reduce_add_rms_norm_reference(
    partials: list[torch.Tensor],  # the ranks' partial sums, each [R, N], in rank order
    residual: torch.Tensor,  # [R, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # the normed rows and the new residual
    """What the kernel computes, in PyTorch: the partial sums added in float32 in rank order and rounded
    once (NCCL's sum of two ranks), then `reference_ops.rms_norm` with the residual."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(residual.dtype)
    out, new_residual = reference_ops.rms_norm(total, weight, eps, residual)
    assert new_residual is not None
    return out, new_residual
