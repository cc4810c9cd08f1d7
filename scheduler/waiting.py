"""The queue of waiting sequences, in admission order: the scheduler's fairness between requests.

Within a priority level, a request that holds fewer seats (running sequences, and the fork children they
will have) goes first, then the earlier request. Ordinary single-sequence requests hold no seat while they
wait, so among them this is first come, first served; but a request with many sequences cannot keep a seat
from one that has none, and each request with sequences waiting gets a seat in turn. A request that holds
no seat competes by its arrival, so none waits forever. Beam searches hold their seats as a group and are
ordered by arrival only (a beam waiting for its search must not queue behind newer requests).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from pagedserve.scheduler.request import Request, SeqStatus, Sequence


def seats_held(request: Request) -> int:
    """Seats the request holds now, as its queue order sees them (0 for a beam search)."""
    if request.beam is not None:
        return 0
    return sum(1 + len(s.fork_children) for s in request.seqs if s.status is SeqStatus.RUNNING)


class WaitingQueue:
    """A heap of requests keyed (priority, seats held, arrival order); each request keeps its own waiting
    sequences in `Request.waiting`. A key records the seats when it was made: `touch` makes a new one when
    a request's seats fall, and one whose seats grew since is remade when it reaches the top. Entries of an
    older `Request.queue_version` are stale and skipped, as are sequences no longer waiting (aborted)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, int, Request]] = []
        self._compact_at = 64  # past this many entries, stale ones are dropped (they may sink for long)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """Every sequence queued (aborted ones too: callers look at the status)."""
        for _, _, _, version, request in self._heap:
            if version == request.queue_version:
                yield from (seq for _, seq in request.waiting)

    def push(self, seq: Sequence) -> None:
        heapq.heappush(seq.request.waiting, (seq.sort_key, seq))
        self._key(seq.request)

    def touch(self, request: Request) -> None:
        """The request's seats fell: it may move up."""
        if request.waiting:
            self._key(request)

    def head(self) -> Sequence | None:
        """The next sequence to admit, or None."""
        heap = self._heap
        while heap:
            _, seats, _, version, request = heap[0]
            waiting = request.waiting
            while waiting and waiting[0][1].status is not SeqStatus.WAITING:
                heapq.heappop(waiting)
            if version != request.queue_version or not waiting:
                heapq.heappop(heap)
            elif seats != seats_held(request):
                heapq.heappop(heap)
                self._key(request)
            else:
                return waiting[0][1]
        return None

    def pop(self, seq: Sequence) -> None:
        """Takes `seq`, which `head()` just returned."""
        _, taken = heapq.heappop(seq.request.waiting)
        assert taken is seq

    def others_wait(self, request: Request) -> bool:
        """Whether a sequence of another request waits."""
        for _, _, _, version, other in self._heap:
            if other is not request and version == other.queue_version:
                if any(s.status is SeqStatus.WAITING for _, s in other.waiting):
                    return True
        return False

    def _key(self, request: Request) -> None:
        request.queue_version += 1
        priority, order, _ = request.waiting[0][0]
        entry = (priority, seats_held(request), order, request.queue_version, request)
        heapq.heappush(self._heap, entry)
        if len(self._heap) > self._compact_at:
            self._heap = [e for e in self._heap if e[3] == e[4].queue_version]
            heapq.heapify(self._heap)
            self._compact_at = 2 * len(self._heap) + 64

    def __len__(self) -> int:
        """Entries in the heap, stale ones included (for tests)."""
        return len(self._heap)
