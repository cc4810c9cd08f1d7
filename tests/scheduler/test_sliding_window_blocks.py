"""Blocks freed behind a sliding window (every layer of the model windowed): the block manager's holes, and
the scheduler with the fake worker, which reads each query's window through the block table and fails on a
block freed too early. A query at position p reads the keys at p - W + 1 .. p (transformers' semantics)."""

from __future__ import annotations

import random

import pytest

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import CodecError, WorkerReady, decode, encode
from pagedserve.scheduler.block_manager import HOLE, NULL_BLOCK, BlockManager
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.scheduler.step import Step
from tests.scheduler.conftest import make_harness
from tests.scheduler.test_memory_management import _assert_nothing_left, _random_arrivals, _run_arrivals


def _windowed(num_blocks: int = 16, window: int = 6, **kw) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=4, sliding_window=window, **kw)


def _expected_holes(num_computed: int, window: int, block_size: int = 4) -> int:
    """Blocks whose every position is below num_computed - window + 1, by brute force over positions."""
    first_read = num_computed - window + 1
    return sum(1 for b in range(64) if (b + 1) * block_size - 1 < first_read)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 13])
def test_a_block_is_freed_exactly_when_its_last_position_leaves_the_window(window):
    bm = _windowed(num_blocks=32, window=window)
    bm.allocate_slots(0, 0, 1)
    for c in range(1, 80):
        freed = bm.free_behind_window(0, c)
        expected = _expected_holes(c, window)
        assert bm.num_holes(0) == expected and freed in (0, 1)
        assert bm.block_table(0)[:expected] == [HOLE] * expected
        assert HOLE not in bm.live_blocks(0)
        # the block holding position c and every block the query at c reads are live
        assert all(bm.block_table(0)[p // 4] != HOLE for p in range(max(0, c - window + 1), c))
        assert bm.allocate_slots(0, c, 1) is not None
        bm.check_invariants()
    assert bm.num_used_blocks == len(bm.live_blocks(0)) <= -(-window // 4) + 1
    bm.free(0)
    assert bm.num_free_blocks == 32
    bm.check_invariants()


def test_no_window_frees_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots(0, 0, 30)
    assert bm.free_behind_window(0, 30) == 0 and bm.num_holes(0) == 0 and bm.num_used_blocks == 8


def test_holes_go_to_the_worker_as_the_null_block():
    bm = _windowed(window=4)
    bm.allocate_slots(0, 0, 13)  # blocks for positions 0..12
    bm.free_behind_window(0, 12)  # the query at 12 reads 9..12: blocks 0 and 1 are dead
    table = bm.block_table(0)
    assert table[:2] == [HOLE, HOLE] and bm.wire_table(0) == [NULL_BLOCK, NULL_BLOCK, *table[2:]]


def test_a_freed_cached_block_stays_in_the_prefix_cache_and_a_hit_never_points_at_a_hole():
    bm = _windowed(window=5)
    tokens = list(range(100, 120))
    bm.allocate_slots(0, 0, 20)
    bm.register_computed(0, tokens, 20)
    bm.free_behind_window(0, 20)  # reads 16..19: blocks 0..3 are dead, block 4 is live
    assert bm.num_holes(0) == 4 and bm.usage({0: 20}).blocks_cached == 4
    cached = set(bm.cached_block_ids())
    bm.free(0)
    hits = bm.find_cached_prefix(1, tokens + [7], "")
    assert len(hits) == 5 and set(hits) == cached | {hits[4]}
    # the new sequence computes from 20: it takes only the hits inside its first query's window
    assert bm.num_blocks_to_admit(hits, 21) == 1 + 1
    bm.allocate_prefix(1, hits)
    assert bm.block_table(1)[:4] == [HOLE] * 4 and bm.block_table(1)[4] == hits[4]
    assert [bm.ref_count(b) for b in hits] == [0, 0, 0, 0, 1]
    assert bm.allocate_slots(1, 20, 1) is not None
    bm.check_invariants()
    # the hashes of the chain stay right: a third sequence with a longer prompt hits through block 5
    bm.register_computed(1, tokens + [7, 8, 9, 10], 24)
    assert len(bm.find_cached_prefix(2, tokens + [7, 8, 9, 10, 11], "")) == 6


def test_swap_moves_only_live_blocks_and_keeps_the_holes():
    bm = _windowed(num_blocks=16, window=6, num_cpu_blocks=4)
    bm.allocate_slots(0, 0, 30)
    bm.free_behind_window(0, 30)  # reads 25..29: blocks 0..5 dead, 6 and 7 live
    assert bm.num_holes(0) == 6 and bm.can_swap_out(0)
    live = bm.live_blocks(0)
    pairs = bm.swap_out(0)
    assert [g for g, _ in pairs] == live and bm.num_free_cpu_blocks == 2
    assert bm.cpu_block_table(0)[:6] == [HOLE] * 6 and bm.num_blocks_to_swap_in(0) == 2
    bm.check_invariants()
    back = bm.swap_in(0)
    assert len(back) == 2 and bm.block_table(0)[:6] == [HOLE] * 6 and bm.num_used_blocks == 2
    bm.check_invariants()
    bm.free(0)
    assert bm.num_free_blocks == 16 and bm.num_free_cpu_blocks == 4
    bm.check_invariants()


def test_fork_shares_live_blocks_and_copies_the_holes():
    bm = _windowed(window=4)
    bm.allocate_slots(0, 0, 14)
    bm.free_behind_window(0, 13)  # reads 10..13: blocks 0 and 1 dead
    bm.fork(0, 1)
    assert bm.block_table(1) == bm.block_table(0) and bm.num_holes(1) == 2
    assert all(bm.ref_count(b) == 2 for b in bm.live_blocks(0))
    alloc = bm.allocate_slots(1, 14, 1)  # the shared partial last block is copied, the holes stay
    assert alloc is not None and len(alloc.copies) == 1 and bm.num_holes(1) == 2
    bm.free_behind_window(1, 16)  # the child moves on alone; the parent still holds block 2
    assert bm.num_holes(1) == 3 and bm.ref_count(bm.block_table(0)[2]) == 1
    bm.check_invariants()
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_usage_counts_only_live_blocks_and_slots():
    bm = _windowed(window=6)
    bm.allocate_slots(0, 0, 22)
    before = bm.usage({0: 22})
    bm.free_behind_window(0, 22)  # reads 17..21: blocks 0..3 dead
    after = bm.usage({0: 22})
    assert (before.blocks_used, before.slots_used) == (6, 22)
    assert (after.blocks_used, after.slots_allocated, after.slots_used) == (2, 8, 22 - 16)


def test_invariants_catch_a_hole_in_the_middle():
    bm = _windowed(window=4)
    bm.allocate_slots(0, 0, 12)
    bm._release(bm._tables[0][1])
    bm._tables[0][1] = HOLE
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ------------------------------------------------------------------------------------------------------------
# the scheduler


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_sequence_far_past_the_window_runs_in_a_pool_too_small_to_hold_it(pipelined):
    """8 blocks of 4 hold 32 tokens; the sequence grows to 120. The fake worker reads every query's window."""
    h = make_harness(
        num_blocks=8, block_size=4, max_num_batched_tokens=8, sliding_window=7, pipelined=pipelined
    )
    assert h.submit("long", list(range(1, 21)), max_tokens=100, seed=1) is None
    used = []
    while h.busy:
        h.step()
        used.append(h.scheduler.kv_usage().blocks_used)
        assert h.steps < 500
    assert len(h.tokens[("long", 0)]) == 100 and h.scheduler.metrics.preemptions_total == 0
    assert max(used) <= 8 and max(used[5:]) <= 4  # the window (7) and the block being written
    _assert_nothing_left(h)


def test_the_same_request_without_a_window_is_refused_by_the_pool():
    h = make_harness(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    assert "more than the whole pool" in h.submit("long", list(range(1, 21)), max_tokens=100)


def test_kv_usage_falls_as_blocks_leave_the_window():
    h = make_harness(num_blocks=64, block_size=4, max_num_batched_tokens=64, sliding_window=8)
    h.submit("a", list(range(1, 41)), max_tokens=20, seed=2)
    h.step()  # the whole prompt in one step: its 10 blocks are held while it is computed
    assert h.scheduler.kv_usage().blocks_used == 10
    h.step()  # the next step's first query is at 40: it reads 33..40, blocks 0..7 go
    assert h.scheduler.kv_usage().blocks_used == 3
    snapshot = h.scheduler.kv_snapshot(4096)
    assert snapshot.requests[0].num_blocks == 3
    h.run()
    _assert_nothing_left(h)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_holes_gives_the_stream_of_a_roomy_pool(mode):
    def run(num_blocks: int):
        h = make_harness(
            num_blocks=num_blocks, block_size=4, max_num_batched_tokens=8, sliding_window=6,
            preemption_mode=mode, num_cpu_blocks=16,
        )  # fmt: skip
        for i in range(4):
            prompt = list(range(10 * i + 1, 10 * i + 15))
            assert h.submit(f"r{i}", prompt, max_tokens=40, seed=i, n=1 + i % 2) is None
        h.run()
        _assert_nothing_left(h)
        return h

    roomy, tight = run(256), run(9)
    assert tight.scheduler.metrics.preemptions_total > 0
    assert tight.tokens == roomy.tokens and tight.finish == roomy.finish


def test_beam_search_with_holes_matches_a_roomy_pool():
    def run(num_blocks: int, window: int):
        h = make_harness(
            num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, sliding_window=window
        )
        assert h.submit("b", list(range(1, 12)), max_tokens=30, n=2, beam_width=3, temperature=0.0) is None
        h.run()
        _assert_nothing_left(h)
        return h

    tight = run(14, 5)
    assert tight.tokens == run(256, 0).tokens and len(tight.tokens) == 2


@pytest.mark.parametrize("trial", range(4))
def test_differential_fuzz_with_a_sliding_window_changes_nothing(trial):
    """The fuzz's random streams with every layer windowed: the same tokens as a roomy pool without caching
    or windows, the fake worker reading each query's window, invariants after every step."""
    rng = random.Random(2000 + trial)
    arrivals = _random_arrivals(rng)
    reference = _run_arrivals(arrivals, 1024, aborts=False, enable_prefix_caching=False)
    window = rng.choice([3, 6, 9])
    configs = [
        dict(num_blocks=1024, enable_prefix_caching=True),
        dict(num_blocks=16, enable_prefix_caching=True),
        dict(num_blocks=16, enable_prefix_caching=False, pipelined=True),
        dict(num_blocks=16, preemption_mode="swap", num_cpu_blocks=64),
        dict(num_blocks=16, preemption_mode="auto", num_cpu_blocks=8, pipelined=True),
        dict(num_blocks=16, enable_prefix_caching=True, num_speculative_tokens=3, pipelined=True),
        dict(num_blocks=16, preemption_mode="swap", num_cpu_blocks=64, num_speculative_tokens=2),
    ]
    for config in configs:
        h = _run_arrivals(arrivals, aborts=False, sliding_window=window, **config)
        assert h.tokens == reference.tokens and h.finish == reference.finish, config


def test_the_window_comes_from_the_worker_and_the_reserved_policies_do_not_free():
    ready = WorkerReady(64, 4, 256, 1000, [2], "/m", "m", sliding_window=12)
    decoded = decode(encode(ready))
    assert decoded == ready and decoded.sliding_window == 12
    with pytest.raises(CodecError):
        decode(encode(WorkerReady(64, 4, 256, 1000, [2], "/m", "m", sliding_window=-1)))
    settings = SchedulerSettings.from_config(SchedulerConfig(), ready)
    assert settings.sliding_window == settings.freeing_window == 12
    assert Scheduler(settings).block_manager.sliding_window == 12
    reserved = SchedulerSettings.from_config(SchedulerConfig(kv_policy="reserved"), ready)
    assert reserved.freeing_window == 0 and Scheduler(reserved).block_manager.sliding_window == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_chunked_prefill_and_its_recompute_free_as_they_pass(caching):
    """A 60-token prompt in chunks of 8, preempted for recompute after 3 chunks: each step holds the window,
    the last chunk and this one, never the whole prompt, the re-prefill too (with the prefix cache, the hits
    behind the window come back as holes); the metrics count live blocks only."""
    h = make_harness(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, sliding_window=6,
        preemption_mode="recompute", enable_prefix_caching=caching,
    )  # fmt: skip
    assert h.submit("p", list(range(1, 61)), max_tokens=4, seed=3) is None
    held = []
    for _ in range(3):
        h.step()
        held.append(h.scheduler.kv_usage().blocks_used)
    s = h.scheduler
    s._preempt(s._running.pick_victim(), Step(s.block_manager, s.settings))
    assert s.block_manager.num_used_blocks == 0
    h.step()  # admitted again: from 24 with the cache's hits (holes up to the window), else from 0
    assert s.block_manager.num_holes(0) == (4 if caching else 0)
    while h.busy:
        h.step()
        held.append(s.kv_usage().blocks_used)
        assert f"pagedserve_kv_blocks_used {float(held[-1])}" in s.metrics_text()
    assert max(held) <= -(-(6 + 8 + 8) // 4) + 2 and len(held) >= (8 if caching else 11)
    assert s.metrics.preemptions_total == 1 and len(h.tokens[("p", 0)]) == 4
    _assert_nothing_left(h)


def test_the_dashboard_snapshot_counts_live_blocks_of_running_and_swapped_sequences():
    h = make_harness(
        num_blocks=64, block_size=4, max_num_batched_tokens=64, sliding_window=8,
        preemption_mode="swap", num_cpu_blocks=16,
    )  # fmt: skip
    h.submit("a", list(range(1, 41)), max_tokens=20, seed=2)
    h.submit("b", list(range(41, 61)), max_tokens=20, seed=3)
    h.step()
    h.step()  # a: 41 tokens computed, blocks 0..7 freed; b: 21, blocks 0..2 freed
    s = h.scheduler
    rows = {r.request_id: r for r in decode(encode(s.kv_snapshot(4096))).requests}
    assert (rows["a"].num_blocks, rows["a"].num_cpu_blocks) == (3, 0)
    assert (rows["b"].num_blocks, rows["b"].num_cpu_blocks) == (3, 0)
    victim = s._running.pick_victim()
    step = Step(s.block_manager, s.settings)
    s._preempt(victim, step)
    h.worker.execute(step.plan(999, [], [], [], []))  # the swap-out reaches the worker
    rows = {r.request_id: r for r in decode(encode(s.kv_snapshot(4096))).requests}
    assert (rows[victim.request.request_id].num_blocks, rows[victim.request.request_id].num_cpu_blocks) == (
        0,
        3,
    )
    assert s.kv_snapshot(4096).num_blocks == 64
    h.run()
    _assert_nothing_left(h)
