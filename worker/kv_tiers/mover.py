"""The worker's KV tiers: the host tier's pinned pool and the disk tier's files, and the copies a plan names.

The scheduler owns which block lives where (scheduler/kv_tiers/); this moves bytes. A plan's tier copies run
before anything else touches the pools (StepPlan order, step 1): disk writes (host slot -> file), offloads
(device block -> host slot), disk reads (file -> host slot), loads (host slot -> device block).

On CUDA the host pool is pinned and the host link's copies run on a stream of their own: an offload gathers
its blocks on the compute stream (a device-to-device copy, so the step's later writes into those blocks are
ordered after it) and copies them to host memory on the side stream, overlapping the step; a load copies
into a staging tensor on the side stream and the compute stream waits for it before the scatter and the
step that reads the blocks. Disk reads and writes touch host memory from the CPU, so they first wait for
the side stream.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import StepPlan
from pagedserve.common.wire_types import MAX_NUM_BLOCKS
from pagedserve.kernels.reference import byte_view
from pagedserve.worker.kv_cache import _BLOCK_DIM, KVPools, _block_ids, _runs, kv_block_bytes
from pagedserve.worker.kv_tiers.disk import DiskTier, identity_digest
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.sequences import Sequences

log = structlog.get_logger(process="worker")

AUTO_HOST_FRACTION = 0.1  # --kv-offload-gb -1: this fraction of the available memory ...
AUTO_HOST_MAX_GIB = 64.0  # ... at most this much


class KVTiers:
    """The host tier's pool, `[num_host_blocks, L, 2, Hkv, block_size, D]` (block-major, as the swap pool),
    the disk tier (or None), and the copies of each plan."""

    def __init__(self, host_pool: torch.Tensor, disk: DiskTier | None, device: torch.device) -> None:
        self.host_pool = host_pool
        self.disk = disk
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._failed: dict[int, list[int]] = {}  # step id -> host slots of its disk reads that failed

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.shape[0]

    @property
    def num_disk_blocks(self) -> int:
        return self.disk.num_slots if self.disk is not None else 0

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def apply(self, plan: StepPlan, device_pool: torch.Tensor) -> None:
        """The plan's tier copies, in the StepPlan order (its ids were checked against the pools)."""
        host = byte_view(self.host_pool)
        pool = byte_view(device_pool)
        if plan.disk_writes or plan.disk_reads:
            if self.stream is not None:
                self.stream.synchronize()  # earlier copies into or out of host memory are done
            assert self.disk is not None
            for slot, disk_slot in plan.disk_writes:
                self.disk.write(disk_slot, _slot_bytes(host, slot).numpy().tobytes())
        if plan.tier_offloads:
            self._offload(pool, host, plan.tier_offloads)
        failed = []
        for disk_slot, slot in plan.disk_reads:
            assert self.disk is not None
            payload = self.disk.read(disk_slot)
            if payload is None:
                failed.append(slot)
            else:
                _slot_bytes(host, slot).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if failed:
            self._failed[plan.step_id] = failed
        if plan.tier_loads:
            self._load(pool, host, plan.tier_loads)

    def take_failed(self, step_id: int) -> list[int]:
        """The host slots of step `step_id`'s disk reads that failed (for its StepOutput)."""
        return self._failed.pop(step_id, [])

    def _offload(self, pool: torch.Tensor, host: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        src = _block_ids([g for g, _ in pairs], pool.device)
        moved = pool.movedim(_BLOCK_DIM, 0)[src].contiguous()  # [n, L, 2, Hkv, block_size, D]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(pool.device))
        with self._side():
            for start, first, n in _runs([h for _, h in pairs]):
                host[first : first + n].copy_(moved[start : start + n], non_blocking=True)
        if self.stream is not None:
            moved.record_stream(self.stream)  # its memory is not reused before the copies read it

    def _load(self, pool: torch.Tensor, host: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        with self._side():
            staging = torch.empty((len(pairs), *host.shape[1:]), dtype=host.dtype, device=pool.device)
            for start, first, n in _runs([h for h, _ in pairs]):
                staging[start : start + n].copy_(host[first : first + n], non_blocking=True)
        if self.stream is not None:
            current = torch.cuda.current_stream(pool.device)
            current.wait_stream(self.stream)
            staging.record_stream(current)
        dst = _block_ids([g for _, g in pairs], pool.device)
        pool.movedim(_BLOCK_DIM, 0)[dst] = staging


def _slot_bytes(host: torch.Tensor, slot: int) -> torch.Tensor:
    """The bytes of one host slot, flat (the same memory)."""
    return host[slot].view(-1).view(torch.uint8)


def num_host_tier_blocks(cfg: WorkerConfig, block_bytes: int, max_blocks_per_seq: int) -> int:
    """Blocks of the host tier: `kv_offload_gb` GiB of them (-1: a fraction of the available memory); with
    a disk tier at least one max-length sequence's worth, since the disk is read through it."""
    if cfg.kv_offload_gb < 0:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(available * AUTO_HOST_FRACTION, AUTO_HOST_MAX_GIB * (1 << 30))
    else:
        budget = cfg.kv_offload_gb * (1 << 30)
    num = int(budget) // block_bytes
    if cfg.kv_disk_dir and num < max_blocks_per_seq:
        num = max_blocks_per_seq
    return min(num, MAX_NUM_BLOCKS)


class _Runner(Protocol):
    """What `attach_kv_tiers` reads of the model runner (worker/model_runner.py)."""

    spec: Any
    kv: KVPools
    shard_config: ModelConfig
    block_size: int
    kv_dtype: torch.dtype
    sequences: Sequences
    parallel: ParallelContext
    device: torch.device


def attach_kv_tiers(runner: _Runner, cfg: WorkerConfig) -> None:
    """Gives the runner's KV pools their tiers, and its plan checks their sizes. None when the host tier
    is off, and none under a draft model (its own KV pool would not come back with a load)."""
    if runner.spec is not None and runner.spec.kv_block_bytes:
        return
    kv = runner.kv
    block_bytes = kv_block_bytes(runner.shard_config, runner.block_size, runner.kv_dtype)
    limits = runner.sequences.limits
    wanted = num_host_tier_blocks(cfg, block_bytes, limits.max_blocks_per_seq)
    num_host = runner.parallel.min_across_ranks(wanted)  # every rank runs the same plans
    if num_host <= 0:
        return
    host_pool = torch.empty(
        (num_host, *kv.cpu_pool.shape[1:]), dtype=kv.cpu_pool.dtype, pin_memory=runner.device.type == "cuda"
    )
    disk = None
    if cfg.kv_disk_dir and runner.parallel.world_size == 1:  # (a failed read must be known to every rank)
        num_disk = min(int(cfg.kv_disk_gb * (1 << 30)) // block_bytes, MAX_NUM_BLOCKS)
        identity = identity_digest(
            {
                "model": str(Path(cfg.model).resolve()),
                "layout": tuple(host_pool.shape[1:]),
                "dtype": str(runner.kv_dtype),
                "rank": runner.parallel.rank,
                "token": secrets.token_hex(16),  # this process: an earlier run's files are foreign
            }
        )
        if num_disk > 0:
            disk = DiskTier(Path(cfg.kv_disk_dir), num_disk, block_bytes, identity)
    kv.tiers = KVTiers(host_pool, disk, runner.device)
    runner.sequences.limits = replace(
        limits, num_host_tier_blocks=num_host, num_disk_tier_blocks=kv.tiers.num_disk_blocks
    )
    log.info(
        "kv_tiers",
        host_blocks=num_host,
        host_gib=round(num_host * block_bytes / (1 << 30), 3),
        disk_blocks=kv.tiers.num_disk_blocks,
        disk_dir=cfg.kv_disk_dir or None,
    )
