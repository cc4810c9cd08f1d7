"""One tier below the GPU pool: a fixed number of slots, each holding one block's KV under its content hash,
evicted least recently used first."""

from __future__ import annotations

from collections import OrderedDict


class TierPool:
    """The slots of one tier (host memory or disk) and which block hash each holds.

    A slot is free, cached (holds a hash: found by `lookup`, evictable), landing (reserved for a copy in
    flight whose content is not yet trusted: neither free nor found) or pinned (cached or landing, and
    touched by the plan being built: never evicted until `end_step`, so that no slot is both written and
    read, or written twice, within one plan)."""

    def __init__(self, num_slots: int, medium: str) -> None:
        self.num_slots = num_slots
        self.medium = medium  # "CPU" or "DISK", as vLLM's KV events name them
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # cached: hash -> slot, least recent first
        self._hash_at: dict[int, bytes] = {}  # cached slot -> its hash
        self._landing: set[int] = set()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot_of

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, h: bytes) -> int | None:
        """The slot holding `h` (marked most recently used), or None."""
        slot = self._slot_of.get(h)
        if slot is not None:
            self._slot_of.move_to_end(h)
        return slot

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def reserve(self) -> tuple[int, bytes | None] | None:
        """A slot to write into, pinned, and the hash it held (evicted: the caller may move it down a tier
        first), or None when every slot is pinned or landing. The slot holds no hash until `store` or
        `land`."""
        if self._free:
            slot = self._free.pop()
            self._pinned.add(slot)
            return slot, None
        for h, slot in self._slot_of.items():  # least recent first; pinned ones are skipped
            if slot not in self._pinned:
                del self._slot_of[h]
                del self._hash_at[slot]
                self._pinned.add(slot)
                return slot, h
        return None

    def store(self, slot: int, h: bytes) -> None:
        """The reserved or landing `slot` now holds `h` (most recently used)."""
        self._landing.discard(slot)
        self._slot_of[h] = slot
        self._hash_at[slot] = h

    def land(self, slot: int) -> None:
        """The reserved `slot` receives a copy not yet trusted (`store` or `release` it later)."""
        self._landing.add(slot)

    def release(self, slot: int) -> None:
        """A reserved or landing slot goes back to the free list, holding nothing."""
        self._landing.discard(slot)
        self._free.append(slot)

    def remove(self, h: bytes) -> None:
        """Forgets `h` (its copy is bad); its slot is free again."""
        slot = self._slot_of.pop(h)
        del self._hash_at[slot]
        self._free.append(slot)

    def end_step(self) -> None:
        """The plan is sent: its slots may be evicted again (later plans run after it on the worker)."""
        self._pinned.clear()

    def check_invariants(self) -> None:
        cached = set(self._hash_at)
        assert len(cached) == len(self._slot_of), f"{self.medium}: a slot holds two hashes"
        assert all(self._hash_at[s] == h for h, s in self._slot_of.items()), f"{self.medium}: maps disagree"
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.medium}: a slot is twice in the free list"
        assert not free & cached and not free & self._landing and not cached & self._landing, (
            f"{self.medium}: a slot is in two states"
        )
        assert len(free) + len(cached) + len(self._landing) == self.num_slots, f"{self.medium}: slots leaked"
        assert all(0 <= s < self.num_slots for s in free | cached | self._landing), f"{self.medium}: bad slot"
