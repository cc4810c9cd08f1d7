"""The passes of one step over its token budget: the running sequences first, then admission.

`RunningPass`: every decode (one token each) in queue order, then the unfinished prefills in queue order
with what is left (chunked prefill: a long prompt never stalls the sequences already generating). When the
pool has no block for one, the run queue picks a victim and the scheduler preempts it
(scheduler/preemption.py).

`Admission`, unless the running pass preempted (admitting more would only thrash): swapped-out sequences
come back first, when their blocks, one more for the next token, and the watermark are free; then waiting
sequences, in the waiting queue's order (fair between requests, scheduler/waiting.py), with nobody
overtaking the head. A new sequence first takes the cached blocks of its prompt's prefix. Each pass stops
at the token budget, at `max_num_seqs` seats, or at the first sequence that does not fit.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.kv_tiers import TieredBlockManager
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.prompt_logprobs import cacheable_prefix
from pagedserve.scheduler.queues import RunQueue, SwappedQueue
from pagedserve.scheduler.request import SeqStatus, Sequence, new_sequence_message
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.scheduler.speculation import Speculation
from pagedserve.scheduler.step import Step
from pagedserve.scheduler.waiting import WaitingQueue


class RunningPass:
    """Schedules the running sequences: decodes, then prefills, preempting the run queue's victims."""

    def __init__(
        self,
        settings: SchedulerSettings,
        block_manager: BlockManager,
        running: RunQueue,
        preempt: Callable[[Sequence, Step], None],
        speculation: Speculation | None = None,
    ) -> None:
        self._speculation = speculation  # draft slots for decodes when the step's spec_k says so
        self._settings = settings
        self._block_manager = block_manager
        self._running = running
        self._preempt = preempt  # takes a victim that pick_victim took off the run queue

    def schedule(self, step: Step, budget: int) -> int:
        """Schedules the running sequences; returns the budget left."""
        # The hot loop: one pass over every running sequence each step, so it avoids helper calls.
        allocate = self._block_manager.allocate_slots
        reserved = self._settings.reserved
        scheduled = step.scheduled
        running = self._running.seqs  # victims leave this list as they are picked
        prefills: list[Sequence] = []
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            num_pending_tokens = seq.num_pending_tokens
            num_tokens = len(seq.token_ids) + num_pending_tokens - seq.num_computed_tokens
            if num_tokens != 1:
                if num_tokens:  # (0: a beam waiting for its search to select)
                    prefills.append(seq)
                continue
            if num_pending_tokens and len(seq.token_ids) + num_pending_tokens >= seq.request.max_total_len:
                continue  # the token in flight is its last
            reserve = self._settings.reserve_tokens(seq) if reserved else 0
            allocation = None
            if step.spec_k and self._speculation and (k := self._speculation.slots(seq, step.spec_k, budget)):
                allocation = allocate(seq.seq_id, seq.num_computed_tokens, 1 + k, reserve)  # never preempts
                if allocation is not None:
                    step.draft_slots.append((seq.seq_id, k))
                    budget -= k
            if allocation is None:
                allocation = allocate(seq.seq_id, seq.num_computed_tokens, 1, reserve)
            while allocation is None:
                # nothing after seq is scheduled yet: the victim comes from there, or is seq itself
                victim = self._running.pick_victim()
                self._preempt(victim, step)
                if victim is seq:
                    break
                allocation = step.allocate(seq, 1)
            if allocation is None:
                break  # seq itself was the last in the queue and is now preempted
            if allocation.new_blocks or allocation.copies:
                step.record_allocation(seq, allocation)
            scheduled.append((seq, 1))
            budget -= 1
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted to make room for a decode
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            allocation = step.allocate(seq, num_tokens)
            while allocation is None:
                victim = self._running.pick_victim({s.seq_id for s, _ in scheduled})
                self._preempt(victim, step)
                if victim is seq:
                    break
                allocation = step.allocate(seq, num_tokens)
            if allocation is None:
                continue
            step.record_allocation(seq, allocation)
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
        return budget


class Admission:
    """Moves sequences from the swapped and waiting queues into the run queue, within a step's budget."""

    def __init__(
        self,
        settings: SchedulerSettings,
        block_manager: BlockManager,
        running: RunQueue,
        waiting: WaitingQueue,
        swapped: SwappedQueue,
        metrics: SchedulerMetrics,
    ) -> None:
        self._settings = settings
        self._block_manager = block_manager
        self._running = running
        self._waiting = waiting
        self._swapped = swapped
        self._metrics = metrics

    def swap_in(self, step: Step, budget: int) -> int:
        """Brings swapped-out sequences back in queue order; returns the budget left."""
        bm, running = self._block_manager, self._running
        while self._swapped and budget > 0 and running.seats_taken < self._settings.max_num_seqs:
            seq = self._swapped.head()
            if seq is None:
                break
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: it comes back once the token is here (next update)
            # its blocks, one more for its next token, and the watermark for the others
            reserve = self._settings.watermark_blocks if running else 0
            if bm.num_blocks_to_swap_in(seq.seq_id) + 1 > bm.num_free_blocks - reserve:
                break
            self._swapped.pop()
            step.swap_in += bm.swap_in(seq.seq_id)
            step.new_block_tables.append((seq.seq_id, bm.wire_table(seq.seq_id)))
            running.add(seq)
            self._metrics.swap_ins_total += 1
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            allocation = step.allocate(seq, num_tokens) if num_tokens else None
            if allocation is None:
                continue  # back on the GPU; it runs in a later step (a beam may wait for its siblings)
            step.record_allocation(seq, allocation)
            step.scheduled.append((seq, num_tokens))
            budget -= num_tokens
        return budget

    def admit_waiting(self, step: Step, budget: int) -> None:
        """Admits waiting sequences in queue order while the budget, the seats and the blocks last."""
        bm, settings = self._block_manager, self._settings
        while budget > 0:
            seq = self._waiting.head()
            if seq is None:
                break
            if seq.num_pending_tokens or seq.num_pending_reports:
                break  # preempted with a token (report) in flight: it is recomputed once that is in
            quota = settings.seat_quota
            if len(seq.fork_children) >= quota and self._waiting.others_wait(seq.request):
                self._queue_surplus_children(seq, quota - 1)
            if self._running.seats_taken + self._seats_needed(seq) > settings.max_num_seqs:
                break
            hits = bm.find_cached_prefix(seq.seq_id, seq.token_ids, seq.request.cache_salt)
            hits = cacheable_prefix(seq.request, hits, settings.block_size)  # prompt logprobs need the rest
            loaded: list[bytes] | None = []  # hashes of the blocks after the hits that host memory holds
            if isinstance(bm, TieredBlockManager) and seq.request.params.prompt_logprobs is None:
                loaded = bm.find_tier_prefix(seq.seq_id, seq.token_ids, len(hits), seq.request.cache_salt)
                if loaded is None:
                    break  # its prefix is on its way from disk to host memory: it waits (in queue order)
            num_computed_tokens = (len(hits) + len(loaded)) * settings.block_size
            num_tokens = min(len(seq.token_ids) - num_computed_tokens, budget)
            reserve = settings.reserve_tokens(seq)
            needed = bm.num_blocks_to_admit(hits, max(num_computed_tokens + num_tokens, reserve))
            watermark = settings.watermark_blocks if self._running else 0
            if needed > bm.num_free_blocks - watermark:
                break  # in queue order: nobody overtakes the head of the queue
            self._waiting.pop(seq)
            if loaded:
                assert isinstance(bm, TieredBlockManager)
                bm.allocate_prefix(seq.seq_id, hits, loaded)
            else:
                bm.allocate_prefix(seq.seq_id, hits)
            allocation = bm.allocate_slots(seq.seq_id, num_computed_tokens, num_tokens, reserve)
            assert allocation is not None and not allocation.copies
            seq.num_computed_tokens = num_computed_tokens
            self._metrics.prefix_cache_queries_total += len(seq.token_ids)
            self._metrics.prefix_cache_hits_total += num_computed_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_computed_tokens
            self._running.add(seq)
            step.new_seqs.append(new_sequence_message(seq, bm.wire_table(seq.seq_id)))
            seq.on_worker = True
            step.scheduled.append((seq, num_tokens))
            budget -= num_tokens

    def _queue_surplus_children(self, seq: Sequence, keep: int) -> None:
        """While other requests wait, a request's first sequence takes at most `seat_quota` seats with it:
        the fork children past `keep` wait as sequences of their own (they find the prompt's blocks in the
        prefix cache), admitted in turn with other requests' sequences."""
        surplus = seq.fork_children[keep:]
        del seq.fork_children[keep:]
        for child in surplus:
            child.status = SeqStatus.WAITING
            child.token_ids = list(child.token_ids)  # it shared the request's prompt list
            self._waiting.push(child)

    def _seats_needed(self, seq: Sequence) -> int:
        """Seats that admitting `seq` takes: itself and the fork children it will have, or for the first
        running beam of a search, the search's whole width."""
        group = seq.request.beam
        if group is not None:
            return 0 if group.seats_held else group.width
        return 1 + len(seq.fork_children)
