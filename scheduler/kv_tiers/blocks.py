"""The block manager with tiers below the GPU pool: the same owner of the GPU pool, telling the tier manager
what it evicts and taking back from it what a new sequence's prefix finds below."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.kv_tiers.manager import TierManager


class TieredBlockManager(BlockManager):
    """A `BlockManager` whose evicted prefix blocks go down to host memory (and disk), and come back."""

    def __init__(self, tiers: TierManager, num_blocks: int, block_size: int, **kwargs: object) -> None:
        super().__init__(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
        if self.sliding_window > 0:
            raise ValueError("KV tiers need every block of a prefix: no sliding window")
        self.tiers = tiers

    def _take_free_block(self) -> int:
        block_id = next(iter(self._free))  # the one the base class takes: the queue's front
        h = self._hash_of[block_id]
        if h is not None:
            self.tiers.evicted(block_id, h)
        return super()._take_free_block()

    def find_tier_prefix(
        self, seq_id: int, token_ids: list[int], num_hits: int, salt: str = ""
    ) -> list[bytes] | None:
        """The hashes of the blocks after the first `num_hits` (the GPU's hits) that host memory holds, to
        pass to `allocate_prefix`; None when the sequence should wait for its prefix to come from disk."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes(seq_id, token_ids, (len(token_ids) - 1) // self.block_size, salt)
        return self.tiers.host_prefix(seq_id, hashes[num_hits:])

    def allocate_prefix(self, seq_id: int, blocks: list[int], loaded: Sequence[bytes] = ()) -> None:
        """Starts the table with the GPU's hits `blocks`, then a fresh block per hash of `loaded` that host
        memory's copy fills in this plan (registered now: the load runs before anything reads it)."""
        self.tiers.pin(list(loaded))  # the blocks taken below may evict to host memory: not these
        super().allocate_prefix(seq_id, blocks)
        table = self._tables[seq_id]
        for h in loaded:
            block_id = self._take_free_block()
            if h not in self._cached:  # (another sequence may have computed it since: keep one)
                self._hash_of[block_id] = h
                self._cached[h] = block_id
            self.tiers.load(h, block_id)
            table.append(block_id)
        self._num_registered[seq_id] = len(table)
        self.tiers.forget(seq_id)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self.tiers.forget(seq_id)

    def check_invariants(self) -> None:
        super().check_invariants()
        self.tiers.check_invariants()


def tiers_of(block_manager: BlockManager) -> TierManager | None:
    """The tier manager below this block manager's GPU pool, if it has one."""
    return block_manager.tiers if isinstance(block_manager, TieredBlockManager) else None


def build_block_manager(
    num_blocks: int,
    block_size: int,
    num_host_blocks: int = 0,
    num_disk_blocks: int = 0,
    tier_block_bytes: int = 0,
    **kwargs: object,
) -> BlockManager:
    """A tiered block manager when there is a host tier and the prefix cache can use it (no sliding
    window), else the plain one."""
    if num_host_blocks > 0 and kwargs.get("enable_prefix_caching", True) and not kwargs.get("sliding_window"):
        tiers = TierManager(num_host_blocks, num_disk_blocks, tier_block_bytes)
        return TieredBlockManager(tiers, num_blocks, block_size, **kwargs)
    return BlockManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
