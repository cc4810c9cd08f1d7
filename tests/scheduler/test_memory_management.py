"""Sharing, prefix caching, swapping, priorities and the reserved policy, through the scheduler's own API
with the fake worker (which checks every KV slot it reads) and invariants after every step."""

from __future__ import annotations

import random

import pytest

from pagedserve.common.messages import FinishReason
from tests.scheduler.conftest import OWNER, make_harness


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def _assert_nothing_left(h) -> None:
    s, bm = h.scheduler, h.scheduler.block_manager
    assert s.num_requests == 0 and not s._seqs and not s._running and s._running.pending_forks == 0
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not bm._tables and not bm._cpu_tables and not bm._seq_hashes and not bm._num_registered
    assert not bm._holes


def test_parallel_samples_prefill_once_and_share_the_prompt_blocks():
    h = make_harness(num_blocks=64, block_size=4)
    h.submit("n4", list(range(1, 11)), max_tokens=6, n=4, seed=3)  # 10 tokens: 2 full blocks + 2 tokens
    h.step()
    first = h.worker.plans[0]
    assert [s.seq_id for s in first.new_seqs] == [0] and first.num_scheduled_tokens == [10]
    assert [(f.parent_seq_id, f.child_seq_id) for f in first.forks] == [(0, 1), (0, 2), (0, 3)]
    usage = h.scheduler.kv_usage()
    assert usage.blocks_used == 3 and usage.blocks_shared == 3 and usage.blocks_saved == 9
    h.step()  # each writes position 10, in the shared partial block: three copies, the last writes in place
    second = h.worker.plans[1]
    assert len(second.block_copies) == 3 and len({src for src, _ in second.block_copies}) == 1
    assert h.scheduler.kv_usage().blocks_shared == 2  # the full prompt blocks stay shared
    h.run()
    assert all(len(h.tokens[("n4", i)]) == 6 for i in range(4))
    assert len({tuple(h.tokens[("n4", i)]) for i in range(4)}) == 4
    _assert_nothing_left(h)


def test_parallel_samples_equal_independent_requests_with_the_same_seeds():
    shared = make_harness(num_blocks=64)
    shared.submit("r", [5, 6, 7, 8, 9], max_tokens=9, n=3, seed=11)
    shared.run()
    # the same sequences, one request each, with the seeds the scheduler derives for indices 0, 1, 2
    seeds = [shared.worker.plans[0].new_seqs[0].seed] + [f.seed for f in shared.worker.plans[0].forks]
    alone = make_harness(num_blocks=64)
    for i, seed in enumerate(seeds):
        alone.submit(f"s{i}", [5, 6, 7, 8, 9], max_tokens=9, seed=seed)
    alone.run()
    assert [shared.tokens[("r", i)] for i in range(3)] == [alone.tokens[(f"s{i}", 0)] for i in range(3)]


def test_prefix_hit_after_the_first_request_finished_reuses_its_blocks():
    h = make_harness(num_blocks=64, block_size=4)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    h.submit("first", prompt, max_tokens=2)
    h.run()
    outputs = []
    h.submit("second", prompt + [1, 2], max_tokens=2)
    while h.scheduler.has_work:
        plan = h.scheduler.schedule()
        outputs += h.scheduler.update(h.worker.execute(plan))
    new = [s for p in h.worker.plans for s in p.new_seqs][-1]
    assert new.num_computed_tokens == 12
    assert h.worker.plans[-2].num_scheduled_tokens == [3]  # only the uncached tail was computed
    assert all(out.num_cached_tokens == 12 for _, out in outputs)
    assert h.scheduler.metrics.prefix_cache_hits_total == 12
    assert h.scheduler.metrics.prefix_cache_queries_total == 13 + 15


def test_fully_cached_prompt_still_computes_its_last_token():
    h = make_harness(num_blocks=64, block_size=4)
    h.submit("a", list(range(8)), max_tokens=1, seed=4)
    h.run()
    h.submit("b", list(range(8)), max_tokens=1, seed=4)
    h.run()
    last = h.worker.plans[-1]
    assert last.new_seqs[0].num_computed_tokens == 4 and last.num_scheduled_tokens == [4]
    assert h.tokens[("a", 0)] == h.tokens[("b", 0)]


def test_prefix_caching_off_computes_everything():
    h = make_harness(num_blocks=64, block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b"):
        h.submit(rid, list(range(12)), max_tokens=1)
        h.run()
    assert h.worker.plans[-1].new_seqs[0].num_computed_tokens == 0
    assert h.scheduler.kv_usage().blocks_cached == 0


def test_cache_salt_keeps_tenants_apart():
    h = make_harness(num_blocks=64, block_size=4)
    from pagedserve.common.messages import SamplingParams, SubmitRequest

    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        msg = SubmitRequest(rid, list(range(12)), SamplingParams(max_tokens=1), cache_salt=salt)
        assert h.scheduler.add_request(OWNER, msg) is None
        h.run()
    computed = [p.new_seqs[0].num_computed_tokens for p in h.worker.plans if p.new_seqs]
    assert computed == [0, 0, 8]


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_gives_identical_streams(mode):
    rng = random.Random(5)
    requests = [(f"r{i}", _prompt(rng, rng.randint(10, 30)), rng.randint(20, 40)) for i in range(10)]

    def run(num_blocks: int, **policies):
        h = make_harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, **policies)
        for rid, prompt, max_tokens in requests:
            assert h.submit(rid, prompt, max_tokens=max_tokens, seed=1) is None
        h.run()
        _assert_nothing_left(h)
        return h

    big = run(512)
    swapping = run(24, preemption_mode=mode, num_cpu_blocks=64)
    if mode == "swap":
        assert swapping.scheduler.metrics.swap_outs_total > 0
        assert swapping.scheduler.metrics.swap_ins_total == swapping.scheduler.metrics.swap_outs_total
    assert dict(swapping.tokens) == dict(big.tokens)


@pytest.mark.parametrize("swap_min_tokens,swapped", [(1000, False), (2, True)])
def test_auto_preemption_swaps_long_sequences_and_recomputes_short_ones(
    monkeypatch, swap_min_tokens, swapped
):
    import pagedserve.scheduler.preemption as sched

    monkeypatch.setattr(sched, "SWAP_MIN_TOKENS", swap_min_tokens)
    h = make_harness(num_blocks=12, block_size=4, preemption_mode="auto", num_cpu_blocks=64)
    h.submit("old", [1] * 16, max_tokens=30)
    h.submit("new", [2] * 16, max_tokens=30)
    while h.scheduler.metrics.preemptions_total == 0:
        assert h.steps < 100
        h.step()
    plan = h.worker.plans[-1]
    assert bool(plan.swap_out) == swapped and (plan.freed_seq_ids == [1]) != swapped
    h.run()
    _assert_nothing_left(h)


def test_swap_in_waits_until_enough_blocks_are_free():
    h = make_harness(num_blocks=12, block_size=4, preemption_mode="swap", num_cpu_blocks=64)
    h.submit("old", [1] * 16, max_tokens=30)
    h.submit("new", [2] * 16, max_tokens=30)
    while h.scheduler.num_swapped_seqs == 0:
        assert h.steps < 100
        h.step()
    swapped_id = h.worker.plans[-1].swap_out[0]  # noqa: F841 (the swap happened in this plan)
    cpu_blocks = len(h.scheduler.block_manager.cpu_block_table(1))
    while h.scheduler.num_swapped_seqs:
        free_before = h.scheduler.block_manager.num_free_blocks
        h.step()
        if h.worker.plans[-1].swap_in:
            assert free_before >= cpu_blocks + 1
        else:
            assert h.scheduler.num_swapped_seqs == 1
    h.run()
    assert len(h.tokens[("old", 0)]) == len(h.tokens[("new", 0)]) == 30
    _assert_nothing_left(h)


def test_preempting_a_sequence_that_shares_blocks_keeps_streams_identical():
    def run(num_blocks: int):
        h = make_harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        h.submit("fan", list(range(20)), max_tokens=30, n=3, seed=9)
        h.submit("other", list(range(100, 118)), max_tokens=30, seed=2)
        h.run()
        _assert_nothing_left(h)
        return h

    big, tiny = run(256), run(20)
    assert tiny.scheduler.metrics.preemptions_total > 0
    assert dict(tiny.tokens) == dict(big.tokens)


def test_priority_policy_orders_admission_and_preempts_the_least_urgent():
    from pagedserve.common.messages import SamplingParams, SubmitRequest

    h = make_harness(num_blocks=256, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in (("low", 5), ("high", -1), ("mid", 2), ("high2", -1)):
        msg = SubmitRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2), priority=priority)
        assert h.scheduler.add_request(OWNER, msg) is None
    h.run()
    admitted = [s.seq_id for p in h.worker.plans for s in p.new_seqs]
    assert admitted == [1, 3, 2, 0]  # high, high2 (same priority: arrival), mid, low

    h = make_harness(num_blocks=10, block_size=4, scheduling_policy="priority")
    for rid, priority in (("urgent", 0), ("lazy", 9)):
        msg = SubmitRequest(rid, [1] * 8, SamplingParams(max_tokens=20), priority=priority)
        h.scheduler.add_request(OWNER, msg)
    while h.scheduler.metrics.preemptions_total == 0:
        h.step()
    assert h.worker.plans[-1].freed_seq_ids == [1]  # "lazy" went, not "urgent"
    h.run()


def test_reserved_policy_claims_the_whole_length_at_admission():
    h = make_harness(num_blocks=64, block_size=4, kv_policy="reserved", max_model_len=256)
    h.submit("r", [1] * 5, max_tokens=30, n=2)
    h.step()
    # no sharing in reserved mode: both sequences prefill and each holds blocks for 35 tokens
    assert [len(h.scheduler.block_manager.block_table(s)) for s in (0, 1)] == [9, 9]
    assert h.worker.plans[0].forks == []
    usage = h.scheduler.kv_usage()
    assert usage.slots_allocated == 18 * 4 and usage.slots_used == 2 * 5
    h.run()
    assert all(not p.new_block_ids for p in h.worker.plans[1:])  # it never grows
    _assert_nothing_left(h)


def test_reserved_max_policy_claims_max_model_len_for_every_sequence():
    h = make_harness(num_blocks=40, block_size=4, kv_policy="reserved-max", max_model_len=64)
    for i in range(3):
        assert h.submit(f"r{i}", [1 + i] * 5, max_tokens=6) is None
    h.step()
    # 16 blocks each whatever the request asks for: two fit in 40 blocks, the third waits for one to end
    tables = {s: len(h.scheduler.block_manager.block_table(s)) for s in (0, 1)}
    assert tables == {0: 16, 1: 16}
    assert {s.seq_id for s in h.worker.plans[0].new_seqs} == {0, 1}
    usage = h.scheduler.kv_usage()
    assert usage.slots_allocated == 32 * 4 and usage.slots_used == 2 * 5
    h.run()
    assert all(len(h.tokens[(f"r{i}", 0)]) == 6 for i in range(3))
    assert max(len(p.new_seqs) for p in h.worker.plans[1:]) == 1  # r2 started alone, after one finished
    _assert_nothing_left(h)


def test_reserved_max_policy_refuses_what_the_pool_cannot_hold_at_max_model_len():
    h = make_harness(num_blocks=12, block_size=4, kv_policy="reserved-max", max_model_len=64)
    assert "whole pool" in h.submit("r", [1] * 5, max_tokens=6)  # 11 tokens, but it would claim 16 blocks


def test_kv_accounting_metrics():
    h = make_harness(num_blocks=64, block_size=4)
    h.submit("a", [1] * 6, max_tokens=5, n=2)
    h.step()
    text = h.scheduler.metrics_text()
    assert "pagedserve_kv_slots_allocated 8.0" in text and "pagedserve_kv_slots_used 6.0" in text
    assert "pagedserve_kv_blocks_shared 2.0" in text
    h.run()
    text = h.scheduler.metrics_text()
    # 10 computed tokens each: the shared prompt block and each sequence's own full second block stay cached
    assert "pagedserve_kv_blocks_used 0.0" in text and "pagedserve_kv_blocks_cached 3.0" in text


def test_aborting_sequence_zero_before_its_fork_hands_the_prompt_to_a_sibling():
    h = make_harness(num_blocks=64, max_num_batched_tokens=4)
    h.submit("r", list(range(10)), max_tokens=3, n=3)
    h.step()  # the parent's prefill is chunked: not done yet
    h.record(h.scheduler.abort(OWNER, "r", index=0, finish_reason=FinishReason.STOP))
    h.run()
    assert h.finish[("r", 0)] == FinishReason.STOP
    assert len(h.tokens[("r", 1)]) == len(h.tokens[("r", 2)]) == 3
    _assert_nothing_left(h)


def _random_arrivals(rng: random.Random) -> list:
    prefixes = [_prompt(rng, rng.randint(4, 20)) for _ in range(3)]
    arrivals = []
    for i in range(24):
        prompt = rng.choice(prefixes) + _prompt(rng, rng.randint(1, 10)) if rng.random() < 0.6 else []
        prompt = prompt or _prompt(rng, rng.randint(1, 24))
        params = dict(max_tokens=rng.randint(1, 24), n=rng.choice([1, 1, 2, 4]), seed=rng.randrange(99))
        if rng.random() < 0.5:  # ends early now and then (4% a token): a pipelined plan computed one too many
            params["stop_token_ids"] = tuple(rng.sample(range(1000), 40))
        arrivals.append((rng.randint(0, 30), f"r{i}", prompt, params, rng.random() < 0.15))
    return arrivals


def _run_arrivals(arrivals: list, num_blocks: int, aborts: bool, **policies):
    h = make_harness(
        num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=24, **policies
    )
    pending = sorted(arrivals, key=lambda a: a[0])
    to_abort: dict[int, list[str]] = {}
    step = 0
    while pending or h.busy:
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, abort = pending.pop(0)
            assert h.submit(rid, prompt, **params) is None
            if abort and aborts:
                to_abort.setdefault(step + 3, []).append(rid)
        for rid in to_abort.pop(step, []):
            h.record(h.scheduler.abort(OWNER, rid))
        if h.busy:
            h.step()
        step += 1
        assert step < 5000
    _assert_nothing_left(h)
    return h


@pytest.mark.parametrize("trial", range(6))
def test_differential_fuzz_caching_swap_and_pool_size_change_nothing(trial):
    """Random streams (arrivals, shared prefixes, n, stop tokens, aborts): every configuration, pipelined
    (async scheduling) or not, yields the same tokens as a roomy pool without caching; aborted requests
    yield a prefix of them."""
    rng = random.Random(1000 + trial)
    arrivals = _random_arrivals(rng)
    reference = _run_arrivals(arrivals, 1024, aborts=False, enable_prefix_caching=False)
    aborted = {a[1] for a in arrivals if a[4]}
    configs = [
        dict(num_blocks=1024, enable_prefix_caching=True),
        dict(num_blocks=24, enable_prefix_caching=True),
        dict(num_blocks=24, enable_prefix_caching=False),
        dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64),
        dict(num_blocks=24, preemption_mode="auto", num_cpu_blocks=8),
        # async scheduling: plans made before the previous step's tokens are in
        dict(num_blocks=1024, enable_prefix_caching=True, pipelined=True),
        dict(num_blocks=24, enable_prefix_caching=True, pipelined=True),
        dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, pipelined=True),
        dict(num_blocks=24, preemption_mode="auto", num_cpu_blocks=8, pipelined=True),
        # speculative decoding: draft slots, accepted runs, rejected slots released (FakeWorker._verify)
        dict(num_blocks=1024, enable_prefix_caching=True, num_speculative_tokens=3),
        dict(num_blocks=24, enable_prefix_caching=True, num_speculative_tokens=4, pipelined=True),
        dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, num_speculative_tokens=2),
        dict(
            num_blocks=24, preemption_mode="auto", num_cpu_blocks=8, num_speculative_tokens=3, pipelined=True
        ),
    ]
    for config in configs:
        h = _run_arrivals(arrivals, aborts=True, **config)
        if config["num_blocks"] < 1024:
            assert h.scheduler.metrics.preemptions_total > 0, config
        if config.get("num_speculative_tokens"):
            m = h.scheduler.metrics
            assert 0 < m.spec_accepted_tokens_total < m.spec_draft_tokens_total, config
        for key, tokens in reference.tokens.items():
            if key[0] in aborted:
                assert h.tokens[key] == tokens[: len(h.tokens[key])], (config, key)
            else:
                assert h.tokens[key] == tokens and h.finish[key] == reference.finish[key], (config, key)


def test_a_priority_under_fcfs_is_refused_not_ignored():
    """fcfs orders by arrival alone: a non-zero priority would change nothing, so it is an error (vLLM's)."""
    from pagedserve.common.messages import ErrorKind, SamplingParams, SubmitRequest

    h = make_harness(num_blocks=64)
    urgent = SubmitRequest("p", [1, 2], SamplingParams(max_tokens=2), priority=3)
    error = h.scheduler.add_request(OWNER, urgent)
    assert error is not None and error.kind == ErrorKind.INVALID_REQUEST
    assert error.message == "Got priority 3 but Priority scheduling is not enabled."
    assert h.scheduler.add_request(OWNER, SubmitRequest("z", [1, 2], SamplingParams(max_tokens=2))) is None
    h.run()  # the harness checks the invariants after every step


def test_a_plan_that_only_swaps_reaches_the_worker():
    """Found by the fuzz (pipelined, swap, arrivals of seed 3011): a step swapped a sequence out and had
    nothing to run, the plan was not sent, and the later swap-in read CPU blocks never written (the fake
    worker's KV check caught a slot of another sequence). Plans that only swap, free or copy are sent."""
    arrivals = _random_arrivals(random.Random(3011))
    h = _run_arrivals(
        arrivals, aborts=True, num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, pipelined=True
    )
    assert any(not p.scheduled_seq_ids and not p.is_noop for p in h.worker.plans)  # the case happened
    assert h.scheduler.metrics.swap_outs_total > 0
