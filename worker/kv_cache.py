"""The worker's KV memory: the device pool the model reads and writes, the CPU swap pool, and the block
copies within the device pool (copy-on-write) and between the two pools (swap out, swap in).

The device pool holds every layer in one tensor, `[num_layers, 2 (K, V), num_blocks, Hkv, block_size, D]`, so
that copying n blocks is one gather and one scatter over all layers, K and V, whatever n. Each block is
head-major in memory (one KV head's tokens contiguous: decode attention at head size 64 reads 2-6 points of
the copy rate faster than from token-major blocks, docs/kernels.md); the model sees per-layer (K, V) views,
each indexed `[num_blocks, block_size, Hkv, D]` (`kernels.reference.head_major`). The CPU pool is
block-major, `[num_blocks, num_layers, 2, Hkv, block_size, D]`: a swapped block is one contiguous piece of
pinned memory, so a swap is a gather or scatter on the GPU plus plain copies over the host link, queued on
the stream without waiting for it (the host prepares the next step while they run).

Block ids come from the scheduler, which owns ref counts and free lists; nothing here decides which block
holds what.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import StepPlan
from pagedserve.common.wire_types import MAX_NUM_BLOCKS
from pagedserve.kernels.reference import byte_view, head_major
from pagedserve.worker.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V) of one layer, each [num_blocks, block_size, Hkv, D]

MAX_SEQS_FOR_CPU_POOL = 256  # the CPU pool never grows past what this many max-length sequences need
_BLOCK_DIM = 2  # the block axis of a pool tensor


def kv_block_bytes(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.kv_size * elem


def determine_num_kv_blocks(
    cfg: WorkerConfig,
    model_cfg: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    cuda_budget_bytes: int = 0,
    extra_block_bytes: int = 0,
) -> int:
    """How many device KV blocks to allocate: the configured number, else what the memory budget holds.

    CPU: `kv_cache_memory_gib`, or a quarter of the available memory, capped at what MAX_SEQS_FOR_CPU_POOL
    sequences of max_model_len need. CUDA: `cuda_budget_bytes`, what the memory profile left for the cache
    (`cuda_kv_budget`). Never more than the wire's MAX_NUM_BLOCKS, which the scheduler would refuse (only a
    tiny model on a large GPU comes near it). `extra_block_bytes`: another pool of as many blocks shares the
    budget (a draft model's, worker/spec/draft_model.py), so each block counts its bytes too.
    """
    num_blocks = _num_kv_blocks(
        cfg, model_cfg, max_model_len, device, dtype, cuda_budget_bytes, extra_block_bytes
    )
    return min(num_blocks, MAX_NUM_BLOCKS)


def _num_kv_blocks(
    cfg: WorkerConfig,
    model_cfg: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    cuda_budget_bytes: int,
    extra_block_bytes: int = 0,
) -> int:
    if cfg.num_kv_blocks > 0:
        return cfg.num_kv_blocks
    per_block = kv_block_bytes(model_cfg, cfg.block_size, dtype) + extra_block_bytes
    if device.type == "cuda":
        if cuda_budget_bytes < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({cuda_budget_bytes / (1 << 30):.2f} GiB after the "
                f"weights and activations); raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return cuda_budget_bytes // per_block
    if cfg.kv_cache_memory_gib > 0:
        budget = int(cfg.kv_cache_memory_gib * (1 << 30))
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    cap = MAX_SEQS_FOR_CPU_POOL * -(-max_model_len // cfg.block_size)
    return max(1, min(budget // per_block, cap))


def cuda_kv_budget(device: torch.device, utilization: float, peak_bytes: int) -> int:
    """Bytes the KV pool may take on `device`: `utilization` of its memory, less the peak that the weights
    and one forward pass at the largest step took (`peak_bytes`, from torch's allocator), less what other
    users of the GPU (the CUDA context, other processes) hold outside torch's allocator."""
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    return int(total * utilization) - peak_bytes - max(0, outside_torch)


def determine_num_cpu_blocks(cfg: WorkerConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Blocks in the CPU swap pool: as many as `swap_space` GiB hold (0 turns swapping off)."""
    if cfg.swap_space <= 0:
        return 0
    num_blocks = int(cfg.swap_space * (1 << 30)) // kv_block_bytes(model_cfg, cfg.block_size, dtype)
    return min(num_blocks, MAX_NUM_BLOCKS)


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Block `dst[i]` becomes a copy of block `src[i]` in every layer, K and V (copy-on-write).

    pool: [L, 2, num_blocks, Hkv, block_size, D]; src, dst: [N] int64 on the pool's device. Every source is
    read before any destination is written; `dst` must hold distinct ids. The one PyTorch op behind
    `KVPools.copy`, so that a kernel can take its place.
    """
    pool = byte_view(pool)
    pool.index_copy_(_BLOCK_DIM, dst, pool.index_select(_BLOCK_DIM, src))


def _block_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on `device`; on CUDA through pinned memory, so that the copy queues on the stream without
    waiting for the step still running there (a plain copy would drain it)."""
    t = torch.tensor(ids, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each run of consecutive ids: one transfer each."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, block, 1))
    return runs


def swap_out_blocks(device_pool: torch.Tensor, cpu_pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """(device block, CPU block): each CPU block becomes a copy of its device block, every layer, K and V.

    One gather on the device into block-major order, then one asynchronous copy into pinned memory per run
    of consecutive CPU blocks. The stream orders everything that touches those bytes later (a swap in that
    reads the CPU block, a step that overwrites the device block), so nothing here waits for the copies.
    """
    device_pool, cpu_pool = byte_view(device_pool), byte_view(cpu_pool)
    src = _block_ids([s for s, _ in pairs], device_pool.device)
    moved = device_pool.movedim(_BLOCK_DIM, 0)[src].contiguous()  # [n, L, 2, Hkv, block_size, D]
    for start, first, n in _runs([d for _, d in pairs]):
        cpu_pool[first : first + n].copy_(moved[start : start + n], non_blocking=True)


def swap_in_blocks(cpu_pool: torch.Tensor, device_pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """(CPU block, device block): each device block becomes a copy of its CPU block, every layer, K and V.

    One asynchronous copy out of pinned memory per run of consecutive CPU blocks into a staging tensor on
    the device, then one scatter into the pool, all queued on the stream.
    """
    cpu_pool, device_pool = byte_view(cpu_pool), byte_view(device_pool)
    staging = torch.empty((len(pairs), *cpu_pool.shape[1:]), dtype=cpu_pool.dtype, device=device_pool.device)
    for start, first, n in _runs([s for s, _ in pairs]):
        staging[start : start + n].copy_(cpu_pool[first : first + n], non_blocking=True)
    dst = _block_ids([d for _, d in pairs], device_pool.device)
    device_pool.movedim(_BLOCK_DIM, 0)[dst] = staging


class TierMover(Protocol):
    """The KV tiers below the device pool (worker/kv_tiers/): they move the blocks a plan names."""

    num_host_blocks: int
    num_disk_blocks: int

    def apply(self, plan: StepPlan, device_pool: torch.Tensor) -> None: ...

    def take_failed(self, step_id: int) -> list[int]: ...


class KVPools:
    """The device KV pool and the CPU swap pool of one worker, and the block copies between them; the
    tiers below (`tiers`, worker/kv_tiers/) when the worker has them."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        c = model_cfg
        per_block = (c.num_kv_heads, block_size, c.head_dim)  # head-major
        # Zeroed, not empty: attention reads whole blocks and masks the unused tail, and a NaN there would
        # survive the zero weight.
        self.device_pool = torch.zeros(
            (c.num_layers, 2, num_blocks, *per_block), dtype=dtype, device=device
        )  # [L, 2, num_blocks, Hkv, block_size, D]
        # Empty is enough here: a CPU block is only ever read after a swap out wrote all of it. Pinned on
        # CUDA, so that transfers run at the link's full rate and do not wait for the host.
        self.cpu_pool = torch.empty(
            (num_cpu_blocks, c.num_layers, 2, *per_block),
            dtype=dtype,
            pin_memory=device.type == "cuda" and num_cpu_blocks > 0,
        )  # [num_cpu_blocks, L, 2, Hkv, block_size, D]: block-major
        self.layers: list[KVCache] = [(head_major(k), head_major(v)) for k, v in self.device_pool]
        self.tiers: TierMover | None = None  # set by worker/kv_tiers attach_kv_tiers

    @property
    def num_blocks(self) -> int:
        return self.device_pool.shape[_BLOCK_DIM]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.shape[0]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device blocks: dst becomes a copy of src in every layer, K and V."""
        if not pairs:
            return
        device = self.device_pool.device
        src, dst = _block_ids([s for s, _ in pairs], device), _block_ids([d for _, d in pairs], device)
        if self.device_pool.is_cuda:  # the Triton kernel moves each byte once (the PyTorch op twice)
            from pagedserve.kernels.cache_ops import copy_blocks as copy_blocks_kernel

            copy_blocks_kernel(self.device_pool, src, dst)
        else:
            copy_blocks(self.device_pool, src, dst)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block): copies each device block into its CPU block."""
        if pairs:
            swap_out_blocks(self.device_pool, self.cpu_pool, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block): copies each CPU block into its device block."""
        if pairs:
            swap_in_blocks(self.cpu_pool, self.device_pool, pairs)

    @property
    def num_host_tier_blocks(self) -> int:
        return self.tiers.num_host_blocks if self.tiers is not None else 0

    @property
    def tier_block_bytes(self) -> int:
        """One block's bytes in the host and disk tiers (0 without tiers)."""
        if self.tiers is None:
            return 0
        return math.prod(self.cpu_pool.shape[1:]) * self.cpu_pool.element_size()  # (the same layout)

    @property
    def num_disk_tier_blocks(self) -> int:
        return self.tiers.num_disk_blocks if self.tiers is not None else 0

    def move_tiers(self, plan: StepPlan) -> None:
        """The plan's KV tier copies (StepPlan step 1)."""
        if self.tiers is None:
            raise RuntimeError("a plan moves KV tier blocks, but this worker has no tiers")
        self.tiers.apply(plan, self.device_pool)

    def failed_disk_reads(self, step_id: int) -> list[int]:
        """The host slots of step `step_id`'s disk reads that failed (for its StepOutput)."""
        return self.tiers.take_failed(step_id) if self.tiers is not None else []
