"""What the block manager tells about its prefix cache, kept as vLLM events until the step is over."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedserve.scheduler.kv_events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    wire_hash,
)


class KVEventSink(Protocol):
    """What the block manager tells of its prefix cache."""

    def stored(
        self, hashes: Sequence[bytes], indices: Sequence[int], token_ids: Sequence[int], salt: str
    ) -> None:
        """Blocks `indices` (ascending, maybe none) of a sequence whose chained hashes are `hashes` were
        registered."""

    def removed(self, digest: bytes) -> None:
        """The block registered under `digest` was evicted."""


class _NoKVEvents:
    """Events off: told everything, keeps nothing."""

    def stored(
        self, hashes: Sequence[bytes], indices: Sequence[int], token_ids: Sequence[int], salt: str
    ) -> None:
        pass

    def removed(self, digest: bytes) -> None:
        pass


NO_KV_EVENTS: KVEventSink = _NoKVEvents()
MAX_PENDING = 1 << 20  # block hashes in events not yet taken, at most (a step makes far fewer)


class KVEventRecorder:
    """Collects the events of one step: the block manager calls `stored` and `removed`, the scheduler's
    server `take`s them after every step. Should nobody take them, the pending events stop at MAX_PENDING
    block hashes: they are replaced by one AllBlocksCleared, which is never wrong (a subscriber then knows
    less than is cached, never more)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = [AllBlocksCleared()]  # a new pool: forget any earlier incarnation
        self._pending = 1  # block hashes (and clears) in `_events`
        self.overflows = 0  # times the pending events were replaced by AllBlocksCleared

    def _room(self, n: int) -> None:
        """Makes room for `n` more hashes, replacing everything pending by one clear if there is none."""
        if self._pending + n > MAX_PENDING:
            self._events, self._pending = [AllBlocksCleared()], 1
            self.overflows += 1
        self._pending += n

    def stored(
        self, hashes: Sequence[bytes], indices: Sequence[int], token_ids: Sequence[int], salt: str
    ) -> None:
        """Blocks `indices` (ascending) of a sequence entered the cache; `hashes` are its chained block
        hashes. One BlockStored per run of consecutive blocks, chained to the block before the run."""
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                self._stored_run(hashes, indices[run_start], indices[k - 1] + 1, token_ids, salt)
                run_start = k

    def _stored_run(
        self, hashes: Sequence[bytes], start: int, end: int, token_ids: Sequence[int], salt: str
    ) -> None:
        bs = self.block_size
        extra = [(salt,) if i == 0 and salt else None for i in range(start, end)]
        self._room(end - start)
        self._events.append(
            BlockStored(
                block_hashes=[wire_hash(h) for h in hashes[start:end]],
                parent_block_hash=wire_hash(hashes[start - 1]) if start > 0 else None,
                token_ids=list(token_ids[start * bs : end * bs]),
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=extra if any(extra) else None,
                group_idx=0,
            )
        )

    def removed(self, digest: bytes) -> None:
        """A block's content was evicted; consecutive evictions share one event."""
        self._room(1)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(wire_hash(digest))
        else:
            self._events.append(
                BlockRemoved(block_hashes=[wire_hash(digest)], medium=MEDIUM_GPU, group_idx=0)
            )

    def take(self) -> list[Event]:
        """The events since the last call, oldest first."""
        events, self._events, self._pending = self._events, [], 0
        return events
