"""The KV pool as a picture: a compact `KVSnapshot` for the api's /dashboard and for `--kv-trace`.

What it costs. A snapshot walks the block tables of the live sequences and the prefix-cache map, never the
whole pool: O(blocks held + blocks cached + requests), so a viewer of a large, mostly free pool costs what
the busy part costs. `SnapshotCache` (the server's) builds one at most every `interval_s` whoever asks; the
scheduler builds none while nobody asks (the api asks only while a browser watches; docs/dashboard.md).

The block map. Cells of `blocks_per_cell` consecutive block ids (1 while the pool has at most `max_cells`
blocks; otherwise the smallest count that fits, so a 100k-block pool shows 25 blocks a cell at 4096 cells).
A cell takes the state most of its blocks are in (free, cached, in use, shared; a tie goes to the later,
busier state), and the owner that holds most of its in-use blocks. Cells go as (state, owner, length) runs
(flat lists of ints: common/messages.py says why): a pool that is mostly free or held in long runs by few
requests is a few hundred bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

import numpy as np

from pagedserve.common.messages import (
    MAX_ROW_RUNS,
    MAX_SNAPSHOT_ROWS,
    KVRequestRow,
    KVSnapshot,
)
from pagedserve.scheduler.block_manager import BlockManager, KVUsage
from pagedserve.scheduler.kv_tiers import tiers_of
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.request import Request, SeqStatus, Sequence

FREE, CACHED, USED, SHARED = 0, 1, 2, 3
DEFAULT_ROWS = 256  # requests listed in a snapshot's table (running ones first); the rest are counted


def block_runs(table: Iterable[int], limit: int = MAX_ROW_RUNS) -> list[int]:
    """`table`'s block ids, sorted, as runs of consecutive ids, flat: first, count, first, count, ...; the
    first `limit` runs."""
    runs: list[int] = []
    end = -1  # one past the last run's last block
    for block_id in sorted(table):
        if block_id == end:
            runs[-1] += 1
        elif len(runs) == 2 * limit:
            break
        else:
            runs += (block_id, 1)
        end = block_id + 1
    return runs


def _request_row(request: Request, state: str, bm: BlockManager, now: float) -> KVRequestRow:
    live = [s for s in request.seqs if s.status is not SeqStatus.FINISHED]
    blocks: set[int] = set()
    num_cpu_blocks = 0
    if state != "waiting":  # a waiting request holds no block
        for seq in live:
            blocks.update(bm.live_blocks(seq.seq_id))  # holes behind a sliding window hold nothing
            num_cpu_blocks += len(bm.cpu_block_table(seq.seq_id)[bm.num_holes(seq.seq_id) :])
    ref = bm.ref_counts()
    first = request.seqs[0] if request.seqs else None
    return KVRequestRow(
        request_id=request.request_id,
        state=state,
        num_seqs=len(live),
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=max((s.num_output_tokens for s in live), default=0),
        num_blocks=len(blocks),
        num_shared_blocks=sum(1 for b in blocks if ref[b] > 1),
        num_cpu_blocks=num_cpu_blocks,
        num_cached_tokens=max(0, first.num_cached_tokens) if first is not None else 0,
        age_s=max(0.0, now - request.arrival_time),
        block_runs=block_runs(blocks),
    )


def _runs(states: np.ndarray, owners: np.ndarray) -> list[int]:
    """Runs of equal neighbours, flat: state, owner, length, state, owner, length, ..."""
    key = states.astype(np.int64) * (MAX_SNAPSHOT_ROWS + 1) + owners
    starts = np.flatnonzero(np.diff(key)) + 1
    bounds = np.concatenate(([0], starts, [len(key)]))
    firsts = bounds[:-1]
    return np.stack((states[firsts], owners[firsts], np.diff(bounds)), axis=1).ravel().tolist()


def _cell_map(bm: BlockManager, owner_of_seq: dict[int, int], per_cell: int) -> list[int]:
    """The map's runs. Python touches only the blocks held; the cached ones' ids, the pool's byte-a-block
    state array and the counts per cell are numpy's."""
    n = bm.num_blocks
    state = np.zeros(n, np.int8)
    cached = bm.cached_block_ids()
    cached_ids = np.fromiter(cached, np.int64, len(cached))
    state[cached_ids] = CACHED  # blocks in use among them are set below
    used: list[int] = []
    used_owner: list[int] = []
    for seq_id, table in bm.tables().items():
        table = table[bm.num_holes(seq_id) :]  # holes behind a sliding window hold nothing
        used.extend(table)
        used_owner.extend([owner_of_seq.get(seq_id, 0)] * len(table))
    used_ids = np.asarray(used, np.int64)
    ref = bm.ref_counts()
    state[used_ids] = np.where(np.asarray([ref[b] for b in used], np.int64) > 1, SHARED, USED)
    owner_ids = np.asarray(used_owner, np.int64)
    if per_cell == 1:
        owner = np.zeros(n, np.int64)
        listed = owner_ids > 0  # a block held by a listed and an unlisted sequence shows the listed one
        owner[used_ids[listed]] = owner_ids[listed]
        return _runs(state, owner)
    # Counts per cell from the blocks that are not free only: a free block is one not counted.
    num_cells = -(-n // per_cell)
    busy = np.flatnonzero(state)  # one pass in C over a byte a block: ~0.1 ms per million blocks
    counts = np.bincount((busy // per_cell) * 4 + state[busy], minlength=num_cells * 4).reshape(num_cells, 4)
    sizes = np.full(num_cells, per_cell, np.int64)
    sizes[-1] = n - (num_cells - 1) * per_cell
    counts[:, FREE] = sizes - counts.sum(axis=1)
    cell_state = np.argmax(counts * 4 + np.arange(4), axis=1)  # most blocks; a tie to the busier state
    cell_owner = np.zeros(num_cells, np.int64)
    listed = owner_ids > 0
    if listed.any():  # each cell's most frequent owner among its held blocks
        keys, votes = np.unique((used_ids[listed] // per_cell) * (MAX_SNAPSHOT_ROWS + 1) + owner_ids[listed],
                                return_counts=True)  # fmt: skip
        cells, owners = keys // (MAX_SNAPSHOT_ROWS + 1), keys % (MAX_SNAPSHOT_ROWS + 1)
        order = np.lexsort((votes, cells))  # by cell, then votes: the last of each cell wins
        cell_owner[cells[order]] = owners[order]
    cell_owner[cell_state < USED] = 0
    return _runs(cell_state, cell_owner)


def _table_order(
    requests: Iterable[Request], running: Iterable[Sequence], swapped: Iterable[Sequence], limit: int
) -> list[tuple[Request, str]]:
    """The first `limit` requests with their state: those with a running sequence (in run-queue order),
    then swapped ones, then the waiting rest in arrival order."""
    order: dict[int, tuple[Request, str]] = {}  # by id(): a Request (a dataclass) is not hashable
    for seq in running:
        order.setdefault(id(seq.request), (seq.request, "running"))
    for seq in swapped:
        if seq.status is SeqStatus.SWAPPED:
            order.setdefault(id(seq.request), (seq.request, "swapped"))
    for request in requests:
        if len(order) >= limit:
            break
        order.setdefault(id(request), (request, "waiting"))
    return list(order.values())[:limit]


def build_snapshot(
    requests: Collection[Request],
    running: Iterable[Sequence],
    swapped: Iterable[Sequence],
    bm: BlockManager,
    usage: KVUsage,
    metrics: SchedulerMetrics,
    counts: tuple[int, int, int],
    now: float,
    max_cells: int,
    query_id: int = 0,
    max_rows: int = DEFAULT_ROWS,
) -> KVSnapshot:
    """The pool now. `counts` is (running, waiting, swapped) sequences; `now` is the clock the requests'
    arrival times are on; the table lists the first `max_rows` requests (running ones first)."""
    ordered = _table_order(requests, running, swapped, min(max_rows, MAX_SNAPSHOT_ROWS))
    rows: list[KVRequestRow] = []
    owner_of_seq: dict[int, int] = {}  # seq_id -> 1 + its request's row
    for request, state in ordered:
        rows.append(_request_row(request, state, bm, now))
        for seq in request.seqs:
            owner_of_seq[seq.seq_id] = len(rows)
    per_cell = max(1, -(-bm.num_blocks // max_cells))
    num_running, num_waiting, num_swapped = counts
    return KVSnapshot(
        query_id=query_id,
        time_s=time.time(),
        num_blocks=bm.num_blocks,
        block_size=bm.block_size,
        blocks_per_cell=per_cell,
        cells=_cell_map(bm, owner_of_seq, per_cell),
        requests=rows,
        num_requests=len(requests),
        blocks_used=usage.blocks_used,
        blocks_cached=usage.blocks_cached,
        blocks_shared=usage.blocks_shared,
        slots_allocated=usage.slots_allocated,
        slots_used=usage.slots_used,
        num_cpu_blocks=bm.num_cpu_blocks,
        cpu_blocks_used=bm.num_cpu_blocks - bm.num_free_cpu_blocks,
        num_running_seqs=num_running,
        num_waiting_seqs=num_waiting,
        num_swapped_seqs=num_swapped,
        preemptions_total=metrics.preemptions_total,
        swap_outs_total=metrics.swap_outs_total,
        swap_ins_total=metrics.swap_ins_total,
        prompt_tokens_total=metrics.prompt_tokens_total,
        generated_tokens_total=metrics.generated_tokens_total,
        **_tier_counts(bm),
    )


def _tier_counts(bm: BlockManager) -> dict[str, int]:
    """The KV tiers' fields of the snapshot (none without tiers: their defaults, 0)."""
    tiers = tiers_of(bm)
    if tiers is None:
        return {}
    counts = {
        "num_host_tier_blocks": tiers.host.num_slots,
        "host_tier_blocks_used": tiers.host.num_cached,
        "host_tier_hits_total": tiers.counters.host_hits,
    }
    if tiers.disk is not None:
        counts |= {
            "num_disk_tier_blocks": tiers.disk.num_slots,
            "disk_tier_blocks_used": tiers.disk.num_cached,
        }
    return counts


MAX_SHARE = 0.01  # of the scheduler's time that snapshots may take, at most


class SnapshotCache:
    """Builds a snapshot at most every `interval_s`, whoever asks: viewers and the trace share it, so any
    number of browsers costs the scheduler one snapshot per interval. A snapshot that took long spaces the
    next one out further, so that building them takes at most MAX_SHARE of the time: a big pool is shown
    less often rather than slowing the engine (a 10 ms snapshot: one a second)."""

    def __init__(
        self,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._timer = timer  # measures a build (the bench passes CPU time)
        self._last: KVSnapshot | None = None
        self._next_at = 0.0
        self._last_cells = 0
        self.num_built = 0
        self.last_build_s = 0.0

    def get(self, build: Callable[[int], KVSnapshot], max_cells: int) -> KVSnapshot:
        """The cached snapshot while it is fresh and of the same size, else a new one from `build`."""
        now = self._clock()
        if self._last is None or now >= self._next_at or max_cells != self._last_cells:
            start = self._timer()
            self._last, self._last_cells = build(max_cells), max_cells
            self.last_build_s = self._timer() - start
            self._next_at = now + max(self.interval_s, self.last_build_s / MAX_SHARE)
            self.num_built += 1
        return self._last

    def clear(self) -> None:
        """Forgets the cached snapshot (its core went with a worker)."""
        self._last = None
