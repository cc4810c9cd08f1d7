"""KV tiers below the GPU pool: host memory, then disk, for evicted prefix-cache blocks (docs/kv_tiers.md).

    pool.py     TierPool: one tier's slots, the hash each holds, LRU eviction, pins for the plan being built
    manager.py  TierManager: the host and disk pools, what an eviction offloads, where a prefix lies below,
                the copies each plan carries (Transfers) and the disk reads its answer confirms
    blocks.py   TieredBlockManager: the block manager's hooks (eviction, prefix lookup, loading back);
                build_block_manager picks it when the worker announced a host tier

The scheduler owns where every block lives; the worker (worker/kv_tiers/) moves the bytes a plan names.
"""

from pagedserve.scheduler.kv_tiers.blocks import TieredBlockManager, build_block_manager, tiers_of
from pagedserve.scheduler.kv_tiers.manager import TierCounters, TierManager, Transfers, Where
from pagedserve.scheduler.kv_tiers.pool import TierPool

__all__ = [
    "TierCounters",
    "TierManager",
    "TierPool",
    "TieredBlockManager",
    "Transfers",
    "Where",
    "build_block_manager",
    "tiers_of",
]
