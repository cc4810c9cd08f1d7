"""The draft model's block allocator: which of its KV pool's blocks each drafting sequence holds.

The draft's pool is its own (worker/spec/draft_model.py), apart from the target's, whose blocks the scheduler
owns; this allocator is the only code that hands out and takes back the draft's blocks. A sequence holds a
row of a `BlockTableArray` (the form `worker.inputs.build_inputs` reads) and the token ids whose keys and
values its blocks hold, in order (`computed`): what the draft has seen, compared with the truth at each
`propose`. No prefix sharing and no copy-on-write: a draft's KV is cheap to recompute, and a shared block
would need ref counts for a few blocks' gain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.worker.sequences import BlockTableArray


@dataclass
class DraftSeq:
    """One sequence's state in the draft's pool."""

    row: int  # its row of the allocator's BlockTableArray
    block_ids: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)  # token ids whose KV the blocks hold, position order
    num_truth: int = 0  # leading `computed` tokens that were the sequence's own tokens at the last propose


class DraftBlockPool:
    """A free list of `num_blocks` blocks and the sequences holding the others."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tables = BlockTableArray(max_blocks_per_seq, initial_rows=8)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.seqs: dict[int, DraftSeq] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get(self, seq_id: int) -> DraftSeq:
        """The sequence's state, a new empty one (no blocks) if it has none."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = DraftSeq(self.tables.add([]))
        return seq

    def blocks_needed(self, seq: DraftSeq, num_tokens: int) -> int:
        """Blocks `seq` lacks to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def truncate(self, seq: DraftSeq, num_tokens: int) -> None:
        """Keeps the KV of the first `num_tokens` computed tokens; the blocks past them go back to the free
        list (what a kept block holds past them is overwritten before anything reads it)."""
        del seq.computed[num_tokens:]
        seq.num_truth = min(seq.num_truth, num_tokens)
        keep = -(-num_tokens // self.block_size)
        if keep < len(seq.block_ids):
            self._free.extend(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
            self.tables.set(seq.row, seq.block_ids)

    def grow(self, seq: DraftSeq, num_tokens: int) -> bool:
        """Gives `seq` the blocks to hold `num_tokens` tokens; False (and nothing given) when too few are
        free or the table would pass its width (max_model_len)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free) or len(seq.block_ids) + need > self.tables.max_blocks_per_seq:
            return False
        if need:
            new = [self._free.pop() for _ in range(need)]
            seq.block_ids += new
            self.tables.extend(seq.row, new)
        return True

    def free(self, seq_id: int) -> None:
        """Returns every block of the sequence; unknown ids are ignored."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        self._free.extend(reversed(seq.block_ids))
        self.tables.free(seq.row)

    def check_invariants(self) -> None:
        """free + held = total, no block twice, each table row as its sequence's block list says."""
        held = [b for seq in self.seqs.values() for b in seq.block_ids]
        every = held + self._free
        assert len(every) == self.num_blocks, (len(held), len(self._free), self.num_blocks)
        assert sorted(every) == list(range(self.num_blocks)), "a block held twice or lost"
        for seq in self.seqs.values():
            assert self.tables.row(seq.row) == seq.block_ids
            assert len(seq.computed) <= len(seq.block_ids) * self.block_size
            assert seq.num_truth <= len(seq.computed)
