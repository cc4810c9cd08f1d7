"""The KV block manager: the only code that touches ref counts, the free list and block tables.

Blocks are handed out on demand, `block_size` token slots at a time, and a sequence's block table lists its
blocks in order, so token position p lives in slot `block_table[p // block_size] * block_size +
p % block_size`. Ref counts are kept per block so that sharing (copy-on-write forks, prefix caching) can be
added without changing the callers.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Owns every KV block of the worker's pool and the block table of every sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in order (empty for a sequence that holds none). Do not mutate."""
        return self._tables.get(seq_id, [])

    def num_missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence still needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grows the sequence's table to cover `num_tokens` tokens and returns the blocks it added.

        All or nothing: when the pool has too few free blocks it returns None and changes nothing.
        """
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > len(self._free):
            return None
        new_blocks = [self._free.popleft() for _ in range(missing)]
        for block_id in new_blocks:
            self._ref_counts[block_id] += 1
        if new_blocks or seq_id not in self._tables:
            self._tables.setdefault(seq_id, []).extend(new_blocks)
        return new_blocks

    def free(self, seq_id: int) -> None:
        """Releases every block the sequence holds; blocks no longer referenced go back to the pool."""
        for block_id in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_invariants(self) -> None:
        """Raises AssertionError when the pool's bookkeeping is inconsistent. For tests and idle checks."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is twice in the free list"
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                counts[block_id] += 1
        assert counts == self._ref_counts, "a ref count differs from the number of tables holding the block"
        free_set = set(free)
        for block_id, count in enumerate(counts):
            assert (count == 0) == (block_id in free_set), f"block {block_id}: ref count {count} vs free list"
        assert len(free) + sum(1 for c in counts if c > 0) == self.num_blocks, "free + used != total"
