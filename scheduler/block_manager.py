"""The KV block manager: the only code that touches ref counts, the free queue, block tables, the
prefix-cache map and the CPU swap pool.

Token position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

Sharing. A block's ref count is the number of block tables holding it. Forked sequences share their
parent's blocks; before a sequence writes into a block it shares, `allocate_slots` gives it a private copy
and returns the (source, destination) pair for the worker. Only a partly filled last block is ever copied:
full blocks are never written again.

Prefix caching. Every full block gets a chained hash (its parent's hash, its token ids, and the request's
cache salt for the first block). A computed full block is registered under its hash; a new sequence whose
leading blocks hash alike takes them by reference instead of computing them. A block whose ref count drops
to zero keeps its content and hash in the free queue until the pool needs it: blocks are taken from the
front, freed blocks join at the back (least recently used goes first) in reverse table order (a sequence's
tail goes before its prefix), and blocks without cached content join at the front.

Swapping. A CPU pool of `num_cpu_blocks` holds the KV of swapped-out sequences; `swap_out` and `swap_in`
move a whole table and return the (from, to) block pairs the worker copies.

Sliding windows (`sliding_window` W > 0: every layer of the model slides, the smallest window). A query at
position p reads the keys at p - W + 1 .. p, so once a sequence's next position is c, the blocks wholly
before c - W + 1 are never read again: `free_behind_window` releases them and their table entries become
holes (`HOLE`). Holes are always a leading run of the table (their count is `num_holes`); they hold no
ref count, move in no swap and are never copied. On the wire a hole is block `NULL_BLOCK` (`wire_table`):
a valid id the worker's kernels never read (they start at the window's first block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pagedserve.scheduler.kv_events.recorder import NO_KV_EVENTS, KVEventSink


@dataclass
class Allocation:
    """What `allocate_slots` did: blocks appended to the table and copy-on-write copies to run first."""

    new_blocks: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (shared source, private destination)
    replaced: bool = False  # the table changed in place (a copy replaced a shared block)


HOLE = -1  # a table entry whose block was freed behind the sliding window
NULL_BLOCK = 0  # what the worker is sent for a hole: any valid id, never read

_NOTHING_NEW = Allocation()  # shared result for allocations that change nothing; callers only read it


@dataclass(frozen=True)
class KVUsage:
    """Where the pool's slots are, for metrics and benchmarks."""

    blocks_used: int  # held by live sequences
    blocks_cached: int  # free, but holding reusable prefix content
    blocks_shared: int  # held by more than one sequence
    blocks_saved: int  # sum over blocks of (ref count - 1): blocks sharing avoids
    slots_allocated: int  # blocks_used * block_size
    slots_used: int  # slots holding a token's KV


def block_hash(parent: bytes | None, token_ids: list[int], salt: str = "") -> bytes:
    """The chained hash of one full block: it names the block's content and everything before it."""
    h = hashlib.sha256(parent or salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Owns every KV block of the worker's GPU and CPU pools and the block table of every sequence."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        sliding_window: int = 0,
        kv_events: KVEventSink = NO_KV_EVENTS,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or sliding_window < 0:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.sliding_window = sliding_window  # > 0: blocks behind it are freed (module docstring)
        self.kv_events = kv_events  # told of every block that enters or leaves the prefix cache
        self._holes: dict[int, int] = {}  # seq_id -> leading holes of its GPU (and CPU) table; absent: 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks  # content hash of a registered block
        self._cached: dict[bytes, int] = {}  # hash -> the block registered under it
        self._tables: dict[int, list[int]] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}  # hashes of a sequence's full blocks, in order
        self._num_registered: dict[int, int] = {}  # leading blocks of the table already registered
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._cpu_tables: dict[int, list[int]] = {}

    # ----------------------------------------------------------------------------------------------------
    # queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's GPU blocks in order (empty when it holds none). Do not mutate."""
        return self._tables.get(seq_id, [])

    def cpu_block_table(self, seq_id: int) -> list[int]:
        """The sequence's CPU blocks while swapped out (its holes stay `HOLE`). Do not mutate."""
        return self._cpu_tables.get(seq_id, [])

    def num_holes(self, seq_id: int) -> int:
        """Leading entries of the sequence's table freed behind the sliding window."""
        return self._holes.get(seq_id, 0)

    def live_blocks(self, seq_id: int) -> list[int]:
        """The sequence's GPU blocks that hold something (its table without the holes)."""
        return self._tables.get(seq_id, [])[self._holes.get(seq_id, 0) :]

    def wire_table(self, seq_id: int) -> list[int]:
        """The sequence's table as the worker is sent it: holes as `NULL_BLOCK`."""
        holes = self._holes.get(seq_id, 0)
        return [NULL_BLOCK] * holes + self._tables.get(seq_id, [])[holes:]

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at position `num_computed_tokens` or later reads (0 without a window)."""
        if self.sliding_window <= 0:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def ref_counts(self) -> Sequence[int]:
        """Every block's ref count, by block id (for snapshots). Do not mutate."""
        return self._ref_counts

    def tables(self) -> Mapping[int, list[int]]:
        """Every sequence's GPU block table by seq_id, read-only (for snapshots)."""
        return MappingProxyType(self._tables)

    def cached_block_ids(self) -> Iterable[int]:
        """Blocks registered in the prefix cache: in use, or free and reusable until evicted."""
        return self._cached.values()

    # ----------------------------------------------------------------------------------------------------
    # prefix cache

    def _hashes(self, seq_id: int, token_ids: list[int], num_full_blocks: int, salt: str) -> list[bytes]:
        """The chained hashes of the sequence's first `num_full_blocks` blocks (extended lazily)."""
        hashes = self._seq_hashes.setdefault(seq_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], salt))
        return hashes

    def find_cached_prefix(self, seq_id: int, token_ids: list[int], salt: str = "") -> list[int]:
        """The cached blocks a new sequence can take for its leading tokens. At least its last token is
        always left to compute, since sampling needs its logits."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._hashes(seq_id, token_ids, (len(token_ids) - 1) // self.block_size, salt):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_computed(
        self, seq_id: int, token_ids: list[int], num_computed_tokens: int, salt: str = ""
    ) -> None:
        """Registers the sequence's blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_registered.get(seq_id, 0)
        if num_full <= start:
            return
        table = self._tables[seq_id]
        hashes = self._hashes(seq_id, token_ids, num_full, salt)
        new = []  # the blocks that enter the cache
        for i in range(max(start, self._holes.get(seq_id, 0)), num_full):
            if self._hash_of[table[i]] is None and hashes[i] not in self._cached:
                new.append(i)
                self._hash_of[table[i]] = hashes[i]
                self._cached[hashes[i]] = table[i]
        self.kv_events.stored(hashes, new, token_ids, salt)
        self._num_registered[seq_id] = num_full

    # ----------------------------------------------------------------------------------------------------
    # allocation

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        h = self._hash_of[block_id]
        if h is not None:  # evict its cached content
            self._hash_of[block_id] = None
            del self._cached[h]
            self.kv_events.removed(h)
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._hash_of[block_id] is None:
                self._free.move_to_end(block_id, last=False)  # nothing worth keeping: reuse it first

    def allocate_prefix(self, seq_id: int, blocks: list[int]) -> None:
        """Starts a sequence's table with cached blocks, taken by reference (those behind the sliding window
        of the first token left to compute stay holes). Must precede `allocate_slots` for the same sequence,
        so that no new block can evict one of its hits."""
        assert seq_id not in self._tables
        holes = min(len(blocks), self.num_dead_blocks(len(blocks) * self.block_size))
        for block_id in blocks[holes:]:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        self._tables[seq_id] = [HOLE] * holes + blocks[holes:]
        if holes:
            self._holes[seq_id] = holes
        self._num_registered[seq_id] = len(blocks)

    def num_blocks_to_admit(self, hits: list[int], num_tokens: int) -> int:
        """Free blocks a new sequence takes: its cache hits that sit in the free queue (those it keeps), and
        new blocks for the rest of `num_tokens`."""
        holes = min(len(hits), self.num_dead_blocks(len(hits) * self.block_size))
        free_hits = sum(1 for block_id in hits[holes:] if self._ref_counts[block_id] == 0)
        return free_hits + max(0, self.blocks_for(num_tokens) - len(hits))

    def free_behind_window(self, seq_id: int, num_computed_tokens: int) -> int:
        """Releases the sequence's blocks that no query at `num_computed_tokens` or later reads (sliding
        window); their entries become holes. Returns how many it released. Pass a count that no rollback
        (rejected drafts) goes below: the blocks are gone for good."""
        table = self._tables.get(seq_id)
        dead = self.num_dead_blocks(num_computed_tokens)
        holes = self._holes.get(seq_id, 0)
        if table is None or dead <= holes:
            return 0
        dead = min(dead, len(table))
        for i in range(dead - 1, holes - 1, -1):  # the later block goes first, as `free` does
            self._release(table[i])
            table[i] = HOLE
        self._holes[seq_id] = dead
        return dead - holes

    def num_blocks_needed(
        self, seq_id: int, num_computed_tokens: int, num_new_tokens: int, reserve: int = 0
    ) -> int:
        """Free blocks `allocate_slots` would take for these arguments."""
        table = self._tables.get(seq_id, ())
        end = max(num_computed_tokens + num_new_tokens, reserve)
        missing = max(0, self.blocks_for(end) - len(table))
        return missing + (1 if self._needs_copy(table, num_computed_tokens, num_new_tokens) else 0)

    def _needs_copy(self, table: list[int] | tuple, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether the first write lands in a block shared with another sequence."""
        index = num_computed_tokens // self.block_size
        return num_new_tokens > 0 and index < len(table) and self._ref_counts[table[index]] > 1

    def allocate_slots(
        self, seq_id: int, num_computed_tokens: int, num_new_tokens: int, reserve: int = 0
    ) -> Allocation | None:
        """Makes room for `num_new_tokens` tokens after the first `num_computed_tokens` (and for at least
        `reserve` tokens in all), copying a shared block the writes would land in.

        All or nothing: when the pool has too few free blocks it returns None and changes nothing.
        """
        table = self._tables.get(seq_id)
        bs = self.block_size
        if table is None:
            table = self._tables[seq_id] = []
        elif num_computed_tokens + num_new_tokens <= len(table) * bs and reserve <= len(table) * bs:
            # The common decode step: the write lands in a block the sequence already holds alone.
            if num_new_tokens == 0 or self._ref_counts[table[num_computed_tokens // bs]] == 1:
                return _NOTHING_NEW
        end = max(num_computed_tokens + num_new_tokens, reserve)
        missing = -(-end // bs) - len(table)
        index = num_computed_tokens // bs
        copy = num_new_tokens > 0 and index < len(table) and self._ref_counts[table[index]] > 1
        if missing <= 0 and not copy:
            return _NOTHING_NEW  # the common decode step: room in the last block
        assert index >= self._holes.get(seq_id, 0) or num_new_tokens == 0, "a write into a hole"
        if max(0, missing) + copy > len(self._free):
            return None
        result = Allocation()
        if copy:
            shared = table[index]
            private = self._take_free_block()
            table[index] = private
            self._release(shared)
            result.copies.append((shared, private))
            result.replaced = True
        for _ in range(self.blocks_for(end) - len(table)):
            result.new_blocks.append(self._take_free_block())
        table.extend(result.new_blocks)
        return result

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Releases the sequence's blocks past those its first `num_tokens` tokens fill (the slots of
        rejected draft tokens; their KV is garbage nobody reads)."""
        table = self._tables.get(seq_id)
        keep = max(self.blocks_for(num_tokens), self._holes.get(seq_id, 0))
        while table is not None and len(table) > keep:
            self._release(table.pop())

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Gives the child the parent's blocks, by reference."""
        table = self._tables[parent_seq_id]
        holes = self._holes.get(parent_seq_id, 0)
        for block_id in table[holes:]:
            self._ref_counts[block_id] += 1
        self._tables[child_seq_id] = list(table)
        if holes:
            self._holes[child_seq_id] = holes
        self._seq_hashes[child_seq_id] = list(self._seq_hashes.get(parent_seq_id, ()))
        self._num_registered[child_seq_id] = self._num_registered.get(parent_seq_id, 0)

    def free(self, seq_id: int) -> None:
        """Releases the sequence's GPU and CPU blocks; its cached content stays reusable until evicted."""
        holes = self._holes.pop(seq_id, 0)
        for block_id in reversed(self._tables.pop(seq_id, [])[holes:]):
            self._release(block_id)
        self._cpu_free.extend(reversed(self._cpu_tables.pop(seq_id, [])[holes:]))
        self._seq_hashes.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)

    # ----------------------------------------------------------------------------------------------------
    # swapping

    def can_swap_out(self, seq_id: int) -> bool:
        return len(self.live_blocks(seq_id)) <= len(self._cpu_free)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Moves the sequence's table to the CPU pool (its live blocks; holes stay holes); returns
        (gpu block, cpu block) pairs to copy."""
        holes = self._holes.get(seq_id, 0)
        live = self._tables.pop(seq_id)[holes:]
        cpu_live = [self._cpu_free.pop() for _ in live]
        self._cpu_tables[seq_id] = [HOLE] * holes + cpu_live
        for block_id in reversed(live):
            self._release(block_id)
        self._num_registered[seq_id] = 0
        return list(zip(live, cpu_live, strict=True))

    def num_blocks_to_swap_in(self, seq_id: int) -> int:
        return len(self._cpu_tables[seq_id]) - self._holes.get(seq_id, 0)

    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Moves the sequence back to new GPU blocks; returns (cpu block, gpu block) pairs to copy, or
        None (changing nothing) when too few GPU blocks are free."""
        holes = self._holes.get(seq_id, 0)
        cpu_live = self._cpu_tables[seq_id][holes:]
        if len(cpu_live) > len(self._free):
            return None
        del self._cpu_tables[seq_id]
        live = [self._take_free_block() for _ in cpu_live]
        self._tables[seq_id] = [HOLE] * holes + live
        self._cpu_free.extend(reversed(cpu_live))
        return list(zip(cpu_live, live, strict=True))

    # ----------------------------------------------------------------------------------------------------
    # accounting and checks

    def usage(self, num_tokens_of: dict[int, int]) -> KVUsage:
        """The pool's usage, given how many tokens each live sequence has in its GPU blocks.

        Costs O(blocks in use), mostly in set operations, never O(pool): a /metrics scrape of a large pool
        must not stall the engine loop."""
        bs = self.block_size
        ref = self._ref_counts
        used = set().union(*self._tables.values())
        used.discard(HOLE)
        shared = {b for b in used if ref[b] > 1}
        slots_used = 0
        shared_fill: dict[int, int] = {}  # a shared block holds as many tokens as its fullest holder says
        for seq_id, table in self._tables.items():
            n = num_tokens_of.get(seq_id, 0)
            holes = self._holes.get(seq_id, 0)
            if shared.isdisjoint(table):  # block i holds min(bs, n - i * bs) tokens: these add up to this
                slots_used += max(0, min(n, len(table) * bs) - holes * bs)
                continue
            for i, block_id in enumerate(table[holes:], holes):
                fill = min(bs, max(0, n - i * bs))
                if block_id in shared:
                    shared_fill[block_id] = max(shared_fill.get(block_id, 0), fill)
                else:
                    slots_used += fill
        # Every hashed block is in the cache map (check_invariants): the cached free ones are the rest.
        hashed_in_use = sum(1 for b in used if self._hash_of[b] is not None)
        return KVUsage(
            blocks_used=self.num_used_blocks,
            blocks_cached=len(self._cached) - hashed_in_use,
            blocks_shared=len(shared),
            blocks_saved=sum(ref[b] - 1 for b in shared),
            slots_allocated=self.num_used_blocks * bs,
            slots_used=slots_used + sum(shared_fill.values()),
        )

    def check_invariants(self) -> None:
        """Raises AssertionError when the pool's bookkeeping is inconsistent. For tests and idle checks."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            holes = self._holes.get(seq_id, 0)
            assert self.sliding_window > 0 or not holes, f"seq {seq_id} has holes without a sliding window"
            assert table[:holes] == [HOLE] * holes and HOLE not in table[holes:], f"seq {seq_id}: stray hole"
            for block_id in table[holes:]:
                counts[block_id] += 1
        for seq_id, holes in self._holes.items():
            assert holes > 0 and (seq_id in self._tables or seq_id in self._cpu_tables), "stale hole count"
        assert counts == self._ref_counts, "a ref count differs from the number of tables holding the block"
        for block_id, count in enumerate(counts):
            assert (count == 0) == (block_id in self._free), (
                f"block {block_id}: ref count {count} vs free queue"
            )
        used = sum(1 for c in counts if c > 0)
        assert len(self._free) + used == self.num_blocks, "free + used != total"
        for h, block_id in self._cached.items():
            assert self._hash_of[block_id] == h, f"cache map and block {block_id} disagree"
        assert sum(1 for h in self._hash_of if h is not None) == len(self._cached), "stray block hash"
        cpu_used = [b for s, t in self._cpu_tables.items() for b in t[self._holes.get(s, 0) :]]
        assert HOLE not in cpu_used, "a stray hole in a CPU table"
        assert len(set(cpu_used)) == len(cpu_used), "a CPU block is in two tables"
        assert not set(cpu_used) & set(self._cpu_free), "a CPU block is both used and free"
        assert len(cpu_used) + len(self._cpu_free) == self.num_cpu_blocks, "CPU blocks leaked"
        assert len(set(self._cpu_free)) == len(self._cpu_free), "a CPU block is twice in the free list"
