"""The running and swapped-out sequences: the run queue with its seats and the choice of a preemption
victim, and the queue of sequences swapped out to the CPU pool. (The waiting queue, with its fairness
between requests, is scheduler/waiting.py.)

Every queue is in queue order, the preemption policy's sort key (scheduler/preemption.py).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Container, Iterable, Iterator

from pagedserve.scheduler.request import Request, SeqStatus, Sequence


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


class RunQueue:
    """The running sequences in queue order, and the seats of `max_num_seqs` they hold: one each, one for
    each fork child a running sequence will have (n > 1, forked once its prompt is done), and a beam
    search's whole width while any of its beams runs (its reserve). A sequence that finished stays in the
    list until `prune()`, which the scheduler calls once per update."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []  # sorted by sort key: the first preemption victim is last
        self._pending_forks = 0  # fork children of running parents: seats they will take
        self._beam_reserve = 0  # seats beam groups with a running beam hold for their other beams

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.seqs)

    def __getitem__(self, index: int) -> Sequence:
        return self.seqs[index]

    @property
    def pending_forks(self) -> int:
        return self._pending_forks

    @property
    def beam_reserve(self) -> int:
        return self._beam_reserve

    @property
    def seats_taken(self) -> int:
        return len(self.seqs) + self._pending_forks + self._beam_reserve

    def add(self, seq: Sequence) -> None:
        """An admitted or swapped-in sequence: it takes its seats."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.seqs, seq, key=_sort_key)
        self._pending_forks += len(seq.fork_children)
        if seq.request.beam is not None:
            self.rebalance_beam_seats(seq.request)

    def add_forked(self, seq: Sequence) -> None:
        """A fork child or a beam clone, whose seat its parent or its search held already."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.seqs, seq, key=_sort_key)

    def release_fork_seats(self, num_children: int) -> None:
        """Fork children of a running parent that were forked, or will not be."""
        self._pending_forks -= num_children

    def pick_victim(self, scheduled: Container[int] = ()) -> Sequence:
        """Takes the last running sequence in queue order whose seq_id is not in `scheduled` (the step's
        scheduled sequences): the newest, or under the priority policy the least urgent. The caller
        preempts it, then `left(victim)`."""
        seqs = self.seqs
        for index in range(len(seqs) - 1, -1, -1):
            if seqs[index].seq_id not in scheduled:
                return seqs.pop(index)
        raise AssertionError("every running sequence is scheduled: the one asking for room is too")

    def left(self, seq: Sequence) -> None:
        """`seq`, taken by `pick_victim`, is no longer running: its seats go."""
        self._pending_forks -= len(seq.fork_children)
        if seq.request.beam is not None:
            self.rebalance_beam_seats(seq.request)

    def prune(self) -> None:
        """Drops the sequences that finished."""
        self.seqs = [s for s in self.seqs if s.status is SeqStatus.RUNNING]

    def tokens_in_flight(self) -> bool:
        """Whether a running sequence waits for a token (or beam report) of a plan in flight."""
        return any(s.num_pending_tokens or s.num_pending_reports for s in self.seqs)

    def rebalance_beam_seats(self, request: Request) -> None:
        """A search holds `width` seats while any of its beams runs: its running beams and a reserve."""
        group = request.beam
        assert group is not None
        running = sum(1 for b in request.live_beams if b.status is SeqStatus.RUNNING)
        held = group.width if running else 0
        self._beam_reserve += (held - running) - (group.seats_held - group.running_beams)
        group.seats_held, group.running_beams = held, running

    def recount_seats(self, searches: Iterable[Request]) -> None:
        """Seat counts from the sequences themselves, after a failure may have left them off."""
        self._pending_forks = sum(len(s.fork_children) for s in self.seqs)
        self._beam_reserve = 0
        for request in searches:
            request.beam.seats_held = request.beam.running_beams = 0  # counted afresh, from zero
            self.rebalance_beam_seats(request)


class SwappedQueue:
    """Sequences swapped out to the CPU pool, a heap in queue order. Aborted ones stay until they reach
    the top; iterating yields them too (callers look at the status)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Sequence]] = []

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in self._heap)

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.sort_key, seq))

    def head(self) -> Sequence | None:
        """The first sequence still swapped out (dropping aborted ones before it), or None."""
        heap = self._heap
        while heap and heap[0][1].status is not SeqStatus.SWAPPED:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self) -> Sequence:
        """Takes the sequence `head()` just returned."""
        return heapq.heappop(self._heap)[1]
