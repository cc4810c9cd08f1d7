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

Prefill chunks' messages (up to 8192 tokens x 4096 x 2 bytes = 64 MiB) can take torch's two-shot all-reduce
(`symm_mem.two_shot_all_reduce_out`: each rank sums its 1/N of the message from every peer, then gathers
the others' sums) through a second, larger buffer. Which sizes it takes is measured, not guessed: `tune`
times NCCL, the one-shot and the two-shot kernels at the sizes in TUNE_SIZES on every rank at start-up, and
a message takes the fastest at the smallest measured size that holds it (the slowest rank's time counts,
and every rank reads the same table: the ranks must agree on each message's path).
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
LARGE_MAX_BYTES = 64 << 20  # a prefill chunk of 8192 tokens x hidden 4096 x bf16: the two-shot buffer
TUNE_SIZES = tuple(1 << p for p in range(18, 27))  # 256 KiB .. 64 MiB, the sizes `tune` measures


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
        # (up to bytes, "one-shot" | "two-shot" | "nccl"), ascending, from `tune`; empty: one-shot up to
        # max_bytes, NCCL above
        self.plan: list[tuple[int, str]] = []
        self.large_buffer: torch.Tensor | None = None  # the two-shot kernel's, made by `tune`
        self.tuning: list[dict[str, Any]] = []  # what `tune` measured

    def method(self, nbytes: int) -> str:
        """The path of a message of `nbytes`: "one-shot", "two-shot" or "nccl"."""
        for limit, method in self.plan:
            if nbytes <= limit:
                return method
        return "one-shot" if nbytes <= self.max_bytes and not self.plan else "nccl"

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` takes a symmetric-memory kernel (else NCCL)."""
        if x.dtype not in _DTYPES or not x.is_contiguous():
            return False
        nbytes = x.numel() * x.element_size()
        method = self.method(nbytes)
        if method == "two-shot":  # its kernel's vectors: 16-byte aligned output, whole vectors
            return nbytes % 16 == 0 and x.data_ptr() % 16 == 0
        return method != "nccl"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, written into `x`."""
        nbytes = x.numel() * x.element_size()
        if self.method(nbytes) == "two-shot":
            assert self.large_buffer is not None
            staged = self.large_buffer[:nbytes].view(x.dtype).view(x.shape)
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, x)
        else:
            staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
            staged.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        self.num_calls += 1
        return x

    def tune(self, group: Any, control_group: Any, iters: int = 10) -> list[dict[str, Any]]:
        """Measures NCCL, one-shot and two-shot at TUNE_SIZES (bf16 messages; GPU time per call, the slowest
        rank's) and sets `plan` from it. Returns the measurements. A collective: every rank at once."""
        import torch.distributed._symmetric_memory as symm_mem

        device = self.buffer.device
        if hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out") and self.large_buffer is None:
            self.large_buffer = symm_mem.empty(LARGE_MAX_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.large_buffer, self.group_name)
        rows: list[dict[str, Any]] = []
        for nbytes in TUNE_SIZES:
            x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)
            times = {}
            for method in ("nccl", "one-shot", "two-shot"):
                if (method == "one-shot" and nbytes > self.max_bytes) or (
                    method == "two-shot" and self.large_buffer is None
                ):
                    continue
                self.plan = [(nbytes, method)]
                times[method] = self._time(x, group if method == "nccl" else None, iters)
            slowest = torch.tensor([times.get(m, float("inf")) for m in ("nccl", "one-shot", "two-shot")])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control_group)  # every rank: same table
            measured = dict(zip(("nccl", "one-shot", "two-shot"), slowest.tolist(), strict=True))
            best = min(measured, key=lambda m: measured[m])
            us = {f"{m}_us": round(t, 1) for m, t in measured.items()}
            rows.append({"bytes": nbytes, **us, "best": best})
        self.plan = [(row["bytes"], row["best"]) for row in rows]
        self.num_calls = 0
        return rows

    def _time(self, x: torch.Tensor, nccl_group: Any, iters: int) -> float:
        """GPU microseconds per all-reduce of `x`: NCCL's over `nccl_group`, else this path's (`plan`'s)."""
        run = (lambda: dist.all_reduce(x, group=nccl_group)) if nccl_group is not None else (lambda: self(x))
        run()  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize(x.device)
        return start.elapsed_time(end) * 1e3 / iters


def all_ranks_ok(why: str, control_group: Any) -> bool:
    """Whether no rank has a reason (`why`, empty where this rank has none) against a path: the ranks take it
    together or not at all (a collective that some ranks skip would hang the others)."""
    ok = torch.tensor([0 if why else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control_group)
    return bool(ok.item())


def make_symm_mem_all_reduce(
    group: Any, control_group: Any, device: torch.device, world_size: int, mode: str, tune: bool = True
) -> tuple[SymmMemAllReduce | None, str]:
    """The one-shot all-reduce for `group`, or None and why not. Every rank decides together (one rank
    without peer access sends every rank to NCCL: a rendezvous that some ranks skip would hang), and the
    result is checked once against the exact sum before the model uses it. With `tune`, the sizes each
    kernel takes are then measured (`SymmMemAllReduce.tune`)."""
    why = "--tp-all-reduce nccl" if mode == "nccl" else symm_mem_supported(device, world_size)
    if not all_ranks_ok(why, control_group):
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
    if not all_ranks_ok(why, control_group):
        return None, why or "the one-shot all-reduce failed on another rank"
    assert comm is not None
    comm.num_calls = 0
    if tune:
        try:
            comm.tuning = comm.tune(group, control_group)
        except Exception as e:  # noqa: BLE001 (a kernel this torch lacks: the same on every rank)
            comm.plan, comm.tuning = [], [{"error": f"{type(e).__name__}: {e}"}]
    return comm, ""
