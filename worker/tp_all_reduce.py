"""A one-shot all-reduce through torch's symmetric memory, for the small messages of tensor parallelism.

A decode step of an 8B model at TP=2 runs 64 all-reduces of batch x 4096 x 2 bytes (0.5-4 MiB). NCCL's ring
takes several round trips per message, each a few microseconds of latency over NVLink; a one-shot
all-reduce has every rank read every peer's whole message straight from the peer's memory (CUDA IPC
buffers that `torch.distributed._symmetric_memory` maps into each process, the barrier on its signal pads)
and sum it in one kernel: one round trip. It needs peer access between the GPUs (NVLink or PCIe P2P), not
NVLink multicast (that is `multimem_all_reduce_`, which these machines lack).

Each message is copied into this rank's symmetric buffer, then `symm_mem.one_shot_all_reduce_out` writes
the sum back into the message: the same in-place contract as `dist.all_reduce`, and both kernels are
captured in CUDA graphs like any other. Messages larger than the buffer (prefill steps), other dtypes, and
every rank without peer access go to NCCL; `--tp-all-reduce nccl` sends everything there.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

# Decode at batch 2048 x hidden 4096 x bf16; a prefill chunk beyond this goes to NCCL, whose ring is as fast
# once the message is large (bandwidth, not latency). The buffer costs this much memory per rank.
DEFAULT_MAX_BYTES = 16 << 20
_DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel is built for


def symm_mem_supported(device: torch.device, world_size: int) -> str:
    """Why this rank cannot run the one-shot all-reduce, or "" when it can."""
    if device.type != "cuda":
        return "not on CUDA"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch.distributed._symmetric_memory: {e}"
    n = torch.cuda.device_count()
    peers = [d for d in range(world_size) if d != device.index]  # rank r on GPU r (worker/parallel.py)
    if n < world_size:
        return f"{n} GPUs on this host for {world_size} ranks (the ranks span hosts)"
    if not all(torch.cuda.can_device_access_peer(device.index, d) for d in peers):
        return "no peer access between this host's GPUs"
    return ""


class SymmMemAllReduce:
    """This rank's symmetric buffer and the group it is shared with; calling it sums a message over the
    ranks in place. Construct it on every rank at once (the rendezvous is a collective)."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            enable(self.group_name)  # torch <= 2.8 needs it; later versions find the group themselves
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.num_calls = 0  # messages that took this path (eager calls and graph captures; not replays)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, written into `x`."""
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        self.num_calls += 1
        return x


def make_symm_mem_all_reduce(
    group: Any, control_group: Any, device: torch.device, world_size: int, mode: str
) -> tuple[SymmMemAllReduce | None, str]:
    """The one-shot all-reduce for `group`, or None and why not. Every rank decides together (one rank
    without peer access sends every rank to NCCL: a rendezvous that some ranks skip would hang), and the
    result is checked once against the exact sum before the model uses it."""
    why = "--tp-all-reduce nccl" if mode == "nccl" else symm_mem_supported(device, world_size)
    ok = torch.tensor([0 if why else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control_group)
    if not ok.item():
        return None, why or "another rank cannot use symmetric memory"
    try:
        comm = SymmMemAllReduce(group, device)
        rank = dist.get_rank(group)
        probe = torch.full((4, 1024), float(rank + 1), dtype=torch.bfloat16, device=device)
        comm(probe)
        expected = world_size * (world_size + 1) / 2
        good = bool((probe == expected).all().item())
        why = "" if good else "the probe's sum came out wrong"
    except Exception as e:  # noqa: BLE001 (an API that this torch lacks, the rendezvous, the kernel)
        comm, why = None, f"{type(e).__name__}: {e}"
    ok = torch.tensor([0 if why else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control_group)
    if not ok.item():
        return None, why or "the one-shot all-reduce failed on another rank"
    assert comm is not None
    comm.num_calls = 0
    return comm, ""
