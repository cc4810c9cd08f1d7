"""The KV snapshot against a brute-force reading of the block manager, block by block: states, owners,
grouping, the request table, the wire's bounds, and the rate limit."""

from __future__ import annotations

import random

import pytest

from pagedserve.common.messages import MAX_SNAPSHOT_ROWS, KVSnapshot, decode, encode
from pagedserve.scheduler.snapshot import CACHED, DEFAULT_ROWS, FREE, SHARED, USED, SnapshotCache, block_runs
from tests.scheduler.conftest import make_harness


def _expand(snapshot: KVSnapshot) -> list[tuple[int, int]]:
    runs = snapshot.cells
    cells = [(runs[r], runs[r + 1]) for r in range(0, len(runs), 3) for _ in range(runs[r + 2])]
    assert len(cells) == -(-snapshot.num_blocks // snapshot.blocks_per_cell)
    return cells


def _reference_states(h) -> list[int]:
    """Each block's state read directly from the block manager's own structures (O(pool))."""
    bm = h.scheduler.block_manager
    cached = set(bm._cached.values())
    states = []
    for b in range(bm.num_blocks):
        ref = bm.ref_count(b)
        states.append(SHARED if ref > 1 else USED if ref == 1 else CACHED if b in cached else FREE)
    return states


def _row_blocks(snapshot: KVSnapshot, row: int) -> set[int]:
    runs = snapshot.requests[row].block_runs
    return {b for r in range(0, len(runs), 2) for b in range(runs[r], runs[r] + runs[r + 1])}


def _check_against_reference(h, snapshot: KVSnapshot) -> None:
    ref = _reference_states(h)
    cells = _expand(snapshot)
    per = snapshot.blocks_per_cell
    for cell, (state, owner) in enumerate(cells):
        group = ref[cell * per : (cell + 1) * per]
        counts = {s: group.count(s) for s in (FREE, CACHED, USED, SHARED)}
        assert state == max(counts, key=lambda s: (counts[s], s)), f"cell {cell}: {group}"
        if per == 1 and state >= USED:  # the owner holds the block
            assert owner >= 1 and cell in _row_blocks(snapshot, owner - 1)
    usage = h.scheduler.kv_usage()
    assert snapshot.blocks_used == usage.blocks_used == sum(1 for s in ref if s >= USED)
    assert snapshot.blocks_cached == usage.blocks_cached == ref.count(CACHED)
    assert snapshot.blocks_shared == ref.count(SHARED)
    bm = h.scheduler.block_manager
    for row in snapshot.requests:
        request = next(r for r in h.scheduler._requests.values() if r.request_id == row.request_id)
        held = {b for s in request.seqs for b in bm.block_table(s.seq_id)}
        assert row.num_blocks == len(held)
        assert row.num_shared_blocks == sum(1 for b in held if bm.ref_count(b) > 1)
    assert decode(encode(snapshot)) == snapshot


@pytest.mark.parametrize("max_cells", [4096, 7])
def test_snapshot_matches_the_block_manager_block_by_block(max_cells):
    rng = random.Random(max_cells)
    h = make_harness(num_blocks=48, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    shared_prefix = [rng.randrange(1000) for _ in range(12)]
    for i in range(10):
        prompt = shared_prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        h.submit(f"r{i}", prompt, max_tokens=rng.randint(2, 14), n=rng.choice([1, 1, 4]), seed=i)
    seen = set()
    while h.busy:
        h.step()
        snapshot = h.scheduler.kv_snapshot(max_cells)
        assert snapshot.blocks_per_cell == -(-48 // min(48, max_cells))
        _check_against_reference(h, snapshot)
        seen.update(snapshot.cells[0::3])
        seen.update(row.state for row in snapshot.requests)
        assert h.steps < 2000
    final = h.scheduler.kv_snapshot(max_cells)
    assert final.requests == [] and final.blocks_used == 0
    assert {USED, SHARED, CACHED} <= seen and "running" in seen and "waiting" in seen


def test_table_shows_prefix_hits_and_shared_blocks():
    h = make_harness(num_blocks=40, block_size=4)
    prefix = list(range(1, 17))  # four full blocks
    h.submit("first", prefix + [100, 101, 102, 103], max_tokens=4)  # a fifth full block of its own
    h.run()
    h.submit("again", prefix + [200], max_tokens=8)
    h.submit("n4", [5, 6, 7, 8, 9, 10], max_tokens=8, n=4, seed=1)
    h.step()
    h.step()
    snapshot = h.scheduler.kv_snapshot(4096)
    rows = {row.request_id: row for row in snapshot.requests}
    assert set(rows) == {"again", "n4"} and all(r.state == "running" for r in rows.values())
    assert rows["again"].num_cached_tokens == 16
    assert rows["n4"].num_seqs == 4 and rows["n4"].num_shared_blocks >= 1
    assert rows["n4"].age_s > 0
    # the first request's blocks past the shared prefix stay cached: free, and reusable
    assert CACHED in snapshot.cells[0::3]


def test_large_pool_snapshot_is_bounded():
    h = make_harness(num_blocks=1 << 20, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    for i in range(300):
        h.submit(f"r{i}", [i % 1000 + 1] * 40, max_tokens=20)
    for _ in range(5):
        h.step()
    snapshot = h.scheduler.kv_snapshot(4096)
    assert snapshot.blocks_per_cell == 256 and len(_expand(snapshot)) == 4096
    assert len(snapshot.requests) == DEFAULT_ROWS < snapshot.num_requests == 300 <= MAX_SNAPSHOT_ROWS
    assert len(b"".join(encode(snapshot))) < 64 * 1024


def test_block_runs_merge_consecutive_ids_and_stop_at_the_limit():
    assert block_runs([7, 3, 4, 5, 9, 10]) == [3, 3, 7, 1, 9, 2]
    assert block_runs(range(0, 20, 2), limit=3) == [0, 1, 2, 1, 4, 1]
    assert block_runs([]) == []


def test_snapshot_cache_builds_at_most_once_per_interval():
    now = [0.0]
    cache = SnapshotCache(0.25, clock=lambda: now[0])
    built = []

    def build(max_cells: int) -> int:
        built.append(max_cells)
        return len(built)

    for step in range(100):  # 100 asks over one second (ten viewers at 10 Hz)
        now[0] = step * 0.01
        cache.get(build, 4096)
    assert len(built) == 4 and cache.num_built == 4
    cache.get(build, 64)  # another size: built now
    assert built[-1] == 64


def test_a_slow_snapshot_spaces_the_next_one_out_to_one_percent_of_the_time():
    now = [0.0]
    timer = [0.0]
    cache = SnapshotCache(0.5, clock=lambda: now[0], timer=lambda: timer[0])

    def slow_build(max_cells: int) -> int:
        timer[0] += 0.02  # 20 ms: the next one no sooner than 2 s later
        return cache.num_built

    for step in range(1000):  # 10 s, asked every 10 ms
        now[0] = step * 0.01
        cache.get(slow_build, 4096)
    assert cache.num_built == 5 and cache.last_build_s == pytest.approx(0.02)
