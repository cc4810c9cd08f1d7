"""What the scheduler exposes for metrics and tests: KV usage, Prometheus text, and the integrity check that
tests run after every step. Read-only: it is handed the owners of the state and asks them."""

from __future__ import annotations

from pagedserve.common.exposition import render
from pagedserve.common.messages import KVSnapshot
from pagedserve.scheduler.block_manager import BlockManager, KVUsage
from pagedserve.scheduler.kv_tiers import tiers_of
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.queues import RunQueue, SwappedQueue
from pagedserve.scheduler.request import Request, SeqStatus, SequenceTable
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.scheduler.snapshot import build_snapshot
from pagedserve.scheduler.vllm_metrics import vllm_families
from pagedserve.scheduler.waiting import WaitingQueue


class Inspection:
    """Read-only views of the scheduler's state, and the check that its owners agree."""

    def __init__(
        self,
        settings: SchedulerSettings,
        requests: dict[tuple[bytes, str], Request],
        seqs: SequenceTable,
        running: RunQueue,
        waiting: WaitingQueue,
        swapped: SwappedQueue,
        block_manager: BlockManager,
        metrics: SchedulerMetrics,
    ) -> None:
        self._settings = settings
        self._requests = requests
        self._seqs = seqs
        self._running = running
        self._waiting = waiting
        self._swapped = swapped
        self._block_manager = block_manager
        self._metrics = metrics

    def num_waiting_seqs(self) -> int:
        return sum(1 for s in self._waiting if s.status is SeqStatus.WAITING)

    def num_swapped_seqs(self) -> int:
        return sum(1 for s in self._swapped if s.status is SeqStatus.SWAPPED)

    def kv_usage(self) -> KVUsage:
        return self._block_manager.usage({s.seq_id: s.num_computed_tokens for s in self._running})

    def kv_snapshot(self, max_cells: int, now: float, query_id: int = 0) -> KVSnapshot:
        """The pool as a picture (scheduler/snapshot.py); `now` is the clock of the requests' arrivals."""
        # Waiting: live sequences neither running nor swapped (fork children waiting for their prompt too),
        # counted without walking the waiting queue, which can hold thousands.
        swapped = self.num_swapped_seqs()
        counts = (len(self._running), len(self._seqs) - len(self._running) - swapped, swapped)
        return build_snapshot(
            self._requests.values(), self._running, self._swapped, self._block_manager, self.kv_usage(),
            self._metrics, counts, now, max_cells, query_id,
        )  # fmt: skip

    def metrics_text(self) -> str:
        running_requests = len({s.request.key for s in self._running})
        usage = self.kv_usage()
        gauges = {
            "pagedserve_requests_running": (running_requests, "Requests with a running sequence"),
            "pagedserve_requests_waiting": (len(self._requests) - running_requests, "Requests queued"),
            "pagedserve_requests_swapped": (self.num_swapped_seqs(), "Sequences swapped out to the CPU pool"),
            "pagedserve_kv_blocks_total": (self._block_manager.num_blocks, "KV blocks in the pool"),
            "pagedserve_kv_blocks_used": (usage.blocks_used, "KV blocks held by live sequences"),
            "pagedserve_kv_blocks_cached": (usage.blocks_cached, "Free KV blocks holding reusable prefixes"),
            "pagedserve_kv_blocks_shared": (usage.blocks_shared, "KV blocks held by several sequences"),
            "pagedserve_kv_blocks_saved": (usage.blocks_saved, "KV blocks that sharing avoids"),
            "pagedserve_kv_slots_allocated": (usage.slots_allocated, "KV slots in blocks held"),
            "pagedserve_kv_slots_used": (usage.slots_used, "KV slots holding a token"),
        }
        vllm = vllm_families(
            self._metrics,
            num_running=running_requests,
            num_waiting=len(self._requests) - running_requests,
            kv_cache_usage=usage.blocks_used / self._block_manager.num_blocks,
            model_name=self._settings.model_name,
            engine=self._settings.data_parallel_rank,
        )
        tiers = tiers_of(self._block_manager)  # host memory and disk below the pool (kv_tiers)
        tier_families = tiers.families() if tiers is not None else []
        return render(self._metrics.families(gauges) + vllm + tier_families)

    def check_invariants(self) -> None:
        """Raises AssertionError when the queues, the sequences and the block manager disagree."""
        bm, running, seqs = self._block_manager, self._running, self._seqs
        bm.check_invariants()
        waiting = [s for s in self._waiting if s.status is SeqStatus.WAITING]
        parked = [  # beams that reported, then were preempted: out of the queue until their search selects
            s for s in seqs.values() if s.status is SeqStatus.WAITING and s.candidates is not None
        ]
        swapped = [s for s in self._swapped if s.status is SeqStatus.SWAPPED]
        fork_pending = [c for s in seqs.values() for c in s.fork_children]
        assert len({s.seq_id for s in waiting}) == len(waiting), "a sequence is twice in the waiting queue"
        assert all(s.status is SeqStatus.RUNNING for s in running), "a non-running sequence is running"
        keys = [s.sort_key for s in running]
        assert keys == sorted(set(keys)), "the running list is out of order"
        assert running.pending_forks == sum(len(s.fork_children) for s in running)
        searches = {s.request.key: s.request for s in seqs.values() if s.request.beam}
        reserve = 0
        for request in searches.values():
            num_running = sum(1 for b in request.live_beams if b.status is SeqStatus.RUNNING)
            assert request.beam.running_beams == num_running and len(request.live_beams) <= request.beam.width
            reserve += (request.beam.width - num_running) if num_running else 0
        assert running.beam_reserve == reserve, "beam seat reserve is off"
        assert running.seats_taken <= self._settings.max_num_seqs
        live = {s.seq_id for s in waiting + parked + swapped + fork_pending + list(running)}
        assert live == set(seqs), "live sequences differ from the queues"
        for seq in running:
            slots = len(bm.block_table(seq.seq_id)) * self._settings.block_size
            assert slots >= seq.num_computed_tokens, f"seq {seq.seq_id} computed past its blocks"
            dead = bm.num_dead_blocks(seq.num_computed_tokens)  # holes only behind the window
            assert bm.num_holes(seq.seq_id) <= dead, f"seq {seq.seq_id} freed a block it may still read"
        for seq in waiting + parked + fork_pending:
            assert not bm.block_table(seq.seq_id), f"queued seq {seq.seq_id} holds blocks"
        for seq in swapped:
            assert not bm.block_table(seq.seq_id) and bm.cpu_block_table(seq.seq_id)
