"""Tensor parallelism: the process group of a worker's ranks, the collectives the model needs, and the fan-out
of the scheduler's messages from rank 0 to the other ranks.

The split is Megatron's. Each of the N ranks holds num_heads/N query heads and num_kv_heads/N KV heads (their
rows of q/k/v, their KV pool), intermediate_size/N rows of gate/up, and the matching input columns of o_proj
and down_proj, whose partial outputs are summed by an all-reduce. The embedding and the LM head are split by
vocabulary rows (ceil(V/N) per rank, the last one padded): a token's embedding comes from the rank that
holds its row, the others add zeros; each rank computes its slice of the logits and an all-gather gives
every rank the full row.

Rank 0 alone talks to the scheduler. It forwards each message it acts on (StepPlan, Shutdown) to the other
ranks as bytes over a gloo group on the CPU, which works whatever the main group's backend is (NCCL on
CUDA), so every rank applies the same plans to the same sequences. Every rank samples from the same gathered
logits; the sampler draws from the sequence's seed and position only, so every rank's copy of a sequence
gets the same new token with no further collective. Only rank 0 reports.

At tensor_parallel_size 1 nothing here touches torch.distributed: the collectives return their input and
the layer helpers are the plain torch calls.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import Shutdown, encode
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.tp_all_reduce import make_symm_mem_all_reduce
from pagedserve.worker.tp_fused import make_row_parallel

KEEPALIVE_S = 60.0  # rank 0 sends an empty message when idle this long, well inside the group's timeout
GROUP_TIMEOUT = timedelta(minutes=30)  # a collective (or a wait for rank 0's next message) longer fails
CLOSE_TIMEOUT = timedelta(seconds=10)  # how long a clean exit waits for the other ranks to leave as well
_SHARDED_SIZES = (
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_HONCHO_INDEX = re.compile(r"\.(\d+)$")


def shard_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shape of one rank's layers: `config` with num_heads, num_kv_heads and intermediate_size divided
    by `world_size`. Raises ValueError when one of them does not divide."""
    if world_size == 1:
        return config
    for name in _SHARDED_SIZES:
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} must divide the model's {name} ({value}); "
                f"choose a size that divides {', '.join(f'{n}={getattr(config, n)}' for n in _SHARDED_SIZES)}"
            )
    return replace(config, **{name: getattr(config, name) // world_size for name in _SHARDED_SIZES})


def honcho_rank() -> int | None:
    """The rank honcho's concurrency index implies (worker.1 -> 0, worker.2 -> 1), or None outside honcho."""
    match = _HONCHO_INDEX.search(os.environ.get("HONCHO_PROCESS_NAME", ""))
    return int(match.group(1)) - 1 if match else None


class ParallelContext:
    """This worker's place in its tensor-parallel group: rank, size, the groups, and the collectives.

    `group` carries the model's collectives (NCCL on CUDA, gloo on CPU); `control_group` is gloo on the CPU
    and carries rank 0's messages to the others. Both are None at size 1, where every collective is a
    no-op.
    """

    def __init__(
        self, rank: int = 0, world_size: int = 1, group: Any = None, control_group: Any = None
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.control_group = control_group
        # The one-shot all-reduce for small messages (worker/tp_all_reduce.py), where it runs; else NCCL
        self.fast_all_reduce: Any = None
        # o_proj's and down_proj's partial sums written into symmetric memory and reduced from there, with
        # the next norm in the fused mode (worker/tp_fused.py); None: they go through `all_reduce`
        self.row_parallel: Any = None
        # When a list: (bytes, "symm_mem" | "nccl") of each all-reduce called (the step profile's sizes)
        self.all_reduce_trace: list[tuple[int, str]] | None = None
        self._last_sent = time.monotonic()  # when rank 0 last sent the others a message

    @property
    def is_driver(self) -> bool:
        """Whether this rank talks to the scheduler and reports sampled tokens."""
        return self.rank == 0

    def shard_model_config(self, config: ModelConfig) -> ModelConfig:
        return shard_model_config(config, self.world_size)

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's slice of the vocabulary; the last slice is padded."""
        rows = -(-vocab_size // self.world_size)
        return self.rank * rows, rows

    # -----------------------------------------------------------------------------------------------------
    # collectives of the model (no-ops at size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place: the one-shot symmetric-memory kernel for messages that
        fit its buffer, NCCL (gloo on the CPU) for the rest."""
        if self.world_size == 1:
            return x
        fast = self.fast_all_reduce is not None and self.fast_all_reduce.fits(x)
        if self.all_reduce_trace is not None:
            self.all_reduce_trace.append((x.numel() * x.element_size(), "symm_mem" if fast else "nccl"))
        if fast:
            return self.fast_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [B, C] -> [B, N * C], rank r's in columns r*C..
        """Every rank's `x`, side by side along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        n, rows = self.world_size, x.shape[0]
        gathered = torch.empty((n * rows, *x.shape[1:]), dtype=x.dtype, device=x.device)  # [N * B, C]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self.group)
        return gathered.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (KV pool sizes, which must agree across the group)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    # -----------------------------------------------------------------------------------------------------
    # rank 0's messages to the others, over the CPU control group

    def forward_to_followers(self, frames: list[bytes]) -> None:
        """Rank 0: hands the two frames of a message it acts on (type byte, payload) to every other rank,
        before acting on it itself. Nothing at size 1."""
        if self.world_size > 1:
            self._send_message(frames)

    def keep_followers_alive(self) -> None:
        """Rank 0, while idle: an empty message now and then, so that the other ranks' wait for the next
        one stays inside the group timeout."""
        if self.world_size > 1 and time.monotonic() - self._last_sent > KEEPALIVE_S:
            self._send_message([])

    def stop_followers(self, reason: str) -> None:
        """Rank 0, on its way out: tells the other ranks to exit, unless they are gone already."""
        if self.world_size == 1:
            return
        try:
            self._send_message(encode(Shutdown(reason)))
        except RuntimeError:  # a follower has exited (stopped by the same signal, say): nothing to tell
            pass

    def _send_message(self, frames: list[bytes]) -> None:
        data = b"".join(frames)
        self._last_sent = time.monotonic()
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.control_group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control_group)

    def receive_message(self) -> list[bytes]:
        """The other ranks: the next message from rank 0 as its two frames, or [] for an empty one. Raises
        RuntimeError when rank 0 has gone away or the group timeout passes."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control_group)
        if size.item() == 0:
            return []
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control_group)
        raw = data.numpy().tobytes()
        return [raw[:1], raw[1:]]

    def close(self, wait_for_others: bool = True) -> None:
        """Leaves the group. With `wait_for_others` (a clean exit), first waits, CLOSE_TIMEOUT at most, until
        every rank is leaving too, so that no rank tears its connections down while another still talks on
        them. Then drops this context's references to the groups, so that they are destroyed now and not
        during the interpreter's exit, where gloo's threads can abort the process."""
        if self.world_size == 1 or self.control_group is None:
            return
        if wait_for_others:
            try:
                dist.monitored_barrier(group=self.control_group, timeout=CLOSE_TIMEOUT)
            except RuntimeError:
                pass  # a rank is gone or stuck: leave all the same
        self.fast_all_reduce = None  # its buffer's peer mappings go before the group they were made in
        self.row_parallel = None
        gc.collect()
        dist.destroy_process_group()
        self.group = self.control_group = None
        gc.collect()


def init_parallel(cfg: WorkerConfig, model_config: ModelConfig) -> tuple[WorkerConfig, ParallelContext]:
    """Joins the tensor-parallel group that `cfg` describes, returning `cfg` with this rank's device made
    explicit (cuda -> cuda:<rank modulo the host's GPUs>) and the context. At size 1: `cfg` unchanged and a
    context with no process group, torch.distributed untouched. `model_config` (the checkpoint's) is checked
    against the group's size first."""
    size = cfg.tensor_parallel_size
    if size == 1:
        return cfg, ParallelContext()
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if not 0 <= cfg.rank < size:
        raise ValueError(f"rank {cfg.rank} is outside a tensor-parallel group of {size}")
    # Fail before the rendezvous, which would otherwise wait for the other ranks first.
    shard_model_config(model_config, size)
    device = cfg.resolved_device
    if device == "cuda":  # ranks fill each host's GPUs in order: 8 ranks on two hosts of 4 -> 0..3, 0..3
        device = f"cuda:{cfg.rank % torch.cuda.device_count()}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, init_method=cfg.dist_init_method, rank=cfg.rank, world_size=size, timeout=GROUP_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    ctx = ParallelContext(cfg.rank, size, dist.group.WORLD, control)
    ctx.fast_all_reduce, why = make_symm_mem_all_reduce(
        dist.group.WORLD, control, torch.device(device), size, cfg.tp_all_reduce
    )
    if why and device.startswith("cuda") and cfg.rank == 0:
        print(f"tensor parallelism: NCCL for every all-reduce ({why})", file=sys.stderr, flush=True)
    elif ctx.fast_all_reduce is not None and cfg.rank == 0:
        plan = ", ".join(f"<= {n >> 10} KiB {m}" for n, m in ctx.fast_all_reduce.plan)
        print(f"tensor parallelism: all-reduce by size (measured): {plan}", file=sys.stderr, flush=True)
    ctx.row_parallel, why = make_row_parallel(
        dist.group.WORLD, control, torch.device(device), size, cfg.tp_all_reduce
    )
    wanted = cfg.tp_all_reduce in ("no-copy", "fused", "auto")
    if why and wanted and device.startswith("cuda") and cfg.rank == 0:
        print(f"tensor parallelism: no fused all-reduce + norm ({why})", file=sys.stderr, flush=True)
    return replace(cfg, device=device), ctx


# ---------------------------------------------------------------------------------------------------------
# The split layers' forward steps: at size 1 exactly the plain torch calls, so one process runs as before.


def vocab_parallel_embedding(
    token_ids: torch.Tensor,  # [T]
    weight: torch.Tensor,  # [rows per rank, H], this rank's slice of the vocabulary
    ctx: ParallelContext,
) -> torch.Tensor:  # [T, H]
    """Embeddings of `token_ids`: each rank looks up the ids in its slice, zeros the others, and the
    all-reduce adds the one non-zero row per token."""
    if ctx.world_size == 1:
        return F.embedding(token_ids, weight)
    rows = weight.shape[0]
    local = token_ids - ctx.rank * rows
    inside = (local >= 0) & (local < rows)
    hidden = F.embedding(torch.where(inside, local, 0), weight)
    hidden.masked_fill_(~inside[:, None], 0)
    return ctx.all_reduce(hidden)


def row_parallel_linear(
    x: torch.Tensor,  # [T, K / N], this rank's slice of the input features
    weight: torch.Tensor,  # [H, K / N]
    bias: torch.Tensor | None,  # [H], whole on every rank
    ctx: ParallelContext,
) -> torch.Tensor:  # [T, H]
    """x @ weight.T summed over the ranks, plus the bias once (rank 0 adds it before the sum)."""
    if ctx.world_size == 1:
        return F.linear(x, weight, bias)
    return ctx.all_reduce(F.linear(x, weight, bias if ctx.rank == 0 else None))


def vocab_parallel_logits(
    hidden: torch.Tensor,  # [B, H]
    weight: torch.Tensor,  # [rows per rank, H], this rank's slice of the LM head
    vocab_size: int,
    ctx: ParallelContext,
) -> torch.Tensor:  # [B, V] on every rank
    """Logits over the whole vocabulary: each rank's slice, gathered, without the padding rows."""
    logits = F.linear(hidden, weight)
    if ctx.world_size == 1:
        return logits
    return ctx.all_gather(logits)[:, :vocab_size]
