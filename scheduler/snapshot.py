"""The KV pool as a picture: a compact `KVSnapshot` for the api's /dashboard and for `--kv-trace`.

What it costs. A snapshot walks the block tables of the live sequences and the prefix-cache map, never the
whole pool: O(blocks held + blocks cached + requests), so a viewer of a large, mostly free pool costs what
the busy part costs. `SnapshotCache` (the server's) builds one at most every `interval_s` whoever asks; the
scheduler builds none while nobody asks (the api asks only while a browser watches; docs/dashboard.md).

The block map. Cells of `blocks_per_cell` consecutive block ids (1 while the pool has at most `max_cells`
blocks; otherwise the smallest count that fits, so a 100k-block pool shows 25 blocks a cell at 4096 cells).
A cell takes the state most of its blocks are in (free, cached, in use, shared; a tie goes to the later,
busier state), and the owner that holds most of its in-use blocks. Cells go as (state, owner, length) runs:
a pool that is mostly free or held in long runs by few requests is a few hundred bytes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from common.messages import (
    MAX_ROW_RUNS,
    MAX_SNAPSHOT_ROWS,
    KVRequestRow,
    KVSnapshot,
)
from scheduler.block_manager import BlockManager, KVUsage
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Request, SeqStatus

FREE, CACHED, USED, SHARED = 0, 1, 2, 3
_STATE_ORDER = {SeqStatus.RUNNING: 0, SeqStatus.SWAPPED: 1}  # table order: running, swapped, waiting


def block_runs(table: Iterable[int], limit: int = MAX_ROW_RUNS) -> list[tuple[int, int]]:
    """`table`'s block ids, sorted, as (first, count) runs of consecutive ids; the first `limit` runs."""
    runs: list[tuple[int, int]] = []
    for block_id in sorted(table):
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif len(runs) == limit:
            break
        else:
            runs.append((block_id, 1))
    return runs


def _request_row(request: Request, bm: BlockManager, now: float) -> tuple[KVRequestRow, set[int]]:
    live = [s for s in request.seqs if s.status is not SeqStatus.FINISHED]
    statuses = {s.status for s in live}
    state = (
        "running"
        if SeqStatus.RUNNING in statuses
        else "swapped"
        if SeqStatus.SWAPPED in statuses
        else "waiting"
    )
    blocks: set[int] = set()
    num_cpu_blocks = 0
    for seq in live:
        blocks.update(bm.block_table(seq.seq_id))
        num_cpu_blocks += len(bm.cpu_block_table(seq.seq_id))
    first = request.seqs[0] if request.seqs else None
    row = KVRequestRow(
        request_id=request.request_id,
        state=state,
        num_seqs=len(live),
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=max((s.num_output_tokens for s in live), default=0),
        num_blocks=len(blocks),
        num_shared_blocks=sum(1 for b in blocks if bm.ref_count(b) > 1),
        num_cpu_blocks=num_cpu_blocks,
        num_cached_tokens=max(0, first.num_cached_tokens) if first is not None else 0,
        age_s=max(0.0, now - request.arrival_time),
        block_runs=block_runs(blocks),
    )
    return row, blocks


def _cell_runs(
    num_blocks: int, per_cell: int, state_of: dict[int, int], owner_of: dict[int, int]
) -> list[tuple[int, int, int]]:
    """The map's (state, owner, length) runs from the states of the blocks that are not free."""
    cells: dict[int, tuple[int, int]] = {}  # cell -> (state, owner), for cells not wholly free
    if per_cell == 1:
        cells = {b: (s, owner_of.get(b, 0)) for b, s in state_of.items()}
    else:
        counts: dict[int, Counter[int]] = {}
        owners: dict[int, Counter[int]] = {}
        for b, s in state_of.items():
            counts.setdefault(b // per_cell, Counter())[s] += 1
            if b in owner_of:
                owners.setdefault(b // per_cell, Counter())[owner_of[b]] += 1
        for cell, count in counts.items():
            size = min(per_cell, num_blocks - cell * per_cell)
            count[FREE] = size - sum(count.values())
            state = max(count, key=lambda s: (count[s], s))
            owner = owners[cell].most_common(1)[0][0] if state >= USED and cell in owners else 0
            cells[cell] = (state, owner)
    num_cells = -(-num_blocks // per_cell)
    runs: list[tuple[int, int, int]] = []
    position = 0  # the first cell not yet in a run

    def add(state: int, owner: int, length: int) -> None:
        if runs and runs[-1][0] == state and runs[-1][1] == owner:
            runs[-1] = (state, owner, runs[-1][2] + length)
        else:
            runs.append((state, owner, length))

    for cell in sorted(cells):
        if cell > position:
            add(FREE, 0, cell - position)
        add(*cells[cell], 1)
        position = cell + 1
    if position < num_cells:
        add(FREE, 0, num_cells - position)
    return runs


def build_snapshot(
    requests: Iterable[Request],
    bm: BlockManager,
    usage: KVUsage,
    metrics: SchedulerMetrics,
    counts: tuple[int, int, int],
    now: float,
    max_cells: int,
    query_id: int = 0,
) -> KVSnapshot:
    """The pool now. `counts` is (running, waiting, swapped) sequences; `now` is the clock the requests'
    arrival times are on."""
    ordered = sorted(
        requests, key=lambda r: (min((_STATE_ORDER.get(s.status, 2) for s in r.seqs), default=2), r.order)
    )
    rows: list[KVRequestRow] = []
    owner_of_seq: dict[int, int] = {}  # seq_id -> 1 + its request's row
    for request in ordered[:MAX_SNAPSHOT_ROWS]:
        row, _ = _request_row(request, bm, now)
        rows.append(row)
        for seq in request.seqs:
            owner_of_seq[seq.seq_id] = len(rows)
    state_of: dict[int, int] = dict.fromkeys(bm.cached_block_ids(), CACHED)  # in-use ones are set below
    owner_of: dict[int, int] = {}
    for seq_id, table in bm.tables().items():
        owner = owner_of_seq.get(seq_id, 0)
        for block_id in table:
            state_of[block_id] = SHARED if bm.ref_count(block_id) > 1 else USED
            if owner and block_id not in owner_of:
                owner_of[block_id] = owner
    per_cell = max(1, -(-bm.num_blocks // max_cells))
    num_running, num_waiting, num_swapped = counts
    return KVSnapshot(
        query_id=query_id,
        time_s=time.time(),
        num_blocks=bm.num_blocks,
        block_size=bm.block_size,
        blocks_per_cell=per_cell,
        cells=_cell_runs(bm.num_blocks, per_cell, state_of, owner_of),
        requests=rows,
        num_requests=len(ordered),
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
    )


class SnapshotCache:
    """Builds a snapshot at most every `interval_s`, whoever asks: viewers and the trace share it, so any
    number of browsers costs the scheduler one snapshot per interval."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: KVSnapshot | None = None
        self._last_at = 0.0
        self._last_cells = 0
        self.num_built = 0

    def get(self, build: Callable[[int], KVSnapshot], max_cells: int) -> KVSnapshot:
        """The cached snapshot while it is fresh and of the same size, else a new one from `build`."""
        now = self._clock()
        if self._last is None or now - self._last_at >= self.interval_s or max_cells != self._last_cells:
            self._last, self._last_at, self._last_cells = build(max_cells), now, max_cells
            self.num_built += 1
        return self._last

    def clear(self) -> None:
        """Forgets the cached snapshot (its core went with a worker)."""
        self._last = None
