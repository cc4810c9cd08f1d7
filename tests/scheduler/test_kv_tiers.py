"""The KV tiers' bookkeeping (scheduler/kv_tiers/): evicted prefix blocks go to host memory, then disk, and
come back to a new sequence's prefix; checked against a simulated worker that moves "bytes" (each block's
content is the hash it was computed for) exactly as a plan says, so a block that comes back wrong fails."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.scheduler.block_manager import block_hash
from pagedserve.scheduler.kv_tiers import TieredBlockManager, TierManager, TierPool, Transfers

BS = 4  # tokens per block


def _hashes(tokens: list[int], salt: str = "") -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BS):
        out.append(block_hash(out[-1] if out else None, tokens[i * BS : (i + 1) * BS], salt))
    return out


class FakeWorker:
    """The bytes side: what each GPU block, host slot and disk slot holds, moved in the plan's order."""

    def __init__(self, fail_reads: float = 0.0, seed: int = 0) -> None:
        self.gpu: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.disk: dict[int, bytes] = {}
        self.fail_reads = fail_reads
        self.rng = random.Random(seed)
        self.loads = 0

    def apply(self, t: Transfers) -> list[int]:
        failed = []
        for h, d in t.disk_writes:
            self.disk[d] = self.host[h]
        for g, h in t.offloads:
            self.host[h] = self.gpu[g]
        for d, h in t.disk_reads:
            if self.rng.random() < self.fail_reads:  # a corrupt file: never used
                self.host[h] = b"garbage"
                failed.append(h)
            else:
                self.host[h] = self.disk[d]
        for h, g in t.loads:
            self.gpu[g] = self.host[h]
            self.loads += 1
        return failed


class Harness:
    """A tiered block manager, its fake worker, and admission as the scheduler does it (passes.py)."""

    def __init__(self, num_blocks: int, num_host: int, num_disk: int = 0, fail_reads: float = 0.0) -> None:
        self.bm = TieredBlockManager(TierManager(num_host, num_disk), num_blocks, BS)
        self.worker = FakeWorker(fail_reads)
        self.step = 0
        self.next_seq = 0
        self.cached_tokens: list[int] = []

    def plan(self) -> None:
        """Sends the plan being built and answers it."""
        failed = self.worker.apply(self.bm.tiers.take_transfers(self.step))
        self.bm.tiers.confirm(self.step, failed)
        self.step += 1
        self.bm.check_invariants()

    def run(self, tokens: list[int], salt: str = "") -> int | None:
        """Admits a sequence for `tokens` (waiting for disk reads as admission does), computes its prompt
        and returns its seq id, or None when the pool has no room. Asserts every reused block's bytes."""
        seq_id, self.next_seq = self.next_seq, self.next_seq + 1
        bm = self.bm
        for _ in range(3):
            hits = bm.find_cached_prefix(seq_id, tokens, salt)
            loaded = bm.find_tier_prefix(seq_id, tokens, len(hits), salt)
            if loaded is not None:
                break
            self.plan()  # the disk reads travel with this plan; the answer confirms them
        assert loaded is not None, "a sequence waited for disk twice"
        computed = (len(hits) + len(loaded)) * BS
        if bm.num_blocks_to_admit(hits, len(tokens)) > bm.num_free_blocks:
            bm.free(seq_id)
            return None
        bm.allocate_prefix(seq_id, hits, loaded)
        assert bm.allocate_slots(seq_id, computed, len(tokens) - computed) is not None
        bm.register_computed(seq_id, tokens, len(tokens), salt)
        table = list(bm.block_table(seq_id))
        failed = self.worker.apply(bm.tiers.take_transfers(self.step))
        hashes = _hashes(tokens, salt)
        for i in range(computed // BS):  # what the sequence reads instead of computing
            assert self.worker.gpu[table[i]] == hashes[i], f"block {i} came back wrong"
        for i in range(computed // BS, len(hashes)):  # the forward writes the rest
            self.worker.gpu[table[i]] = hashes[i]
        for i in range(len(hashes), len(table)):
            self.worker.gpu[table[i]] = b"partial"
        bm.tiers.confirm(self.step, failed)
        self.step += 1
        self.cached_tokens.append(computed)
        bm.check_invariants()
        return seq_id


def _conversation(c: int, turns: int) -> list[int]:
    return [1000 * c + t for t in range(turns * 3 * BS)]


def test_an_evicted_prefix_comes_back_from_host_memory():
    h = Harness(num_blocks=8, num_host=32)
    first = _conversation(0, 2)  # 6 blocks
    h.bm.free(h.run(first))
    for c in range(1, 4):  # three others push it out of the GPU pool
        h.bm.free(h.run(_conversation(c, 2)))
    assert h.bm.find_cached_prefix(99, first) == []  # gone from the GPU
    h.run(first + [7, 7])
    assert h.cached_tokens[-1] == 6 * BS and h.bm.tiers.counters.host_hits == 6


def test_salt_is_part_of_every_tier_key():
    h = Harness(num_blocks=8, num_host=32)
    h.bm.free(h.run(_conversation(0, 2), salt="a"))
    for c in range(1, 4):
        h.bm.free(h.run(_conversation(c, 2)))
    h.bm.free(h.run(_conversation(0, 2) + [5], salt="b"))
    assert h.cached_tokens[-1] == 0
    h.run(_conversation(0, 2) + [5], salt="a")
    assert h.cached_tokens[-1] == 6 * BS


def test_host_overflow_goes_to_disk_and_comes_back_through_host_memory():
    h = Harness(num_blocks=8, num_host=6, num_disk=64)
    first = _conversation(0, 2)
    h.bm.free(h.run(first))
    for c in range(1, 5):
        h.bm.free(h.run(_conversation(c, 2)))
    assert h.bm.tiers.counters.disk_writes > 0
    h.run(first + [3])
    assert h.cached_tokens[-1] == 6 * BS and h.bm.tiers.counters.disk_hits == 6


def test_a_failed_disk_read_is_a_miss_and_is_forgotten():
    h = Harness(num_blocks=8, num_host=6, num_disk=64, fail_reads=1.0)
    first = _conversation(0, 2)
    h.bm.free(h.run(first))
    for c in range(1, 5):
        h.bm.free(h.run(_conversation(c, 2)))
    h.bm.free(h.run(first + [3]))  # FakeWorker asserts nothing bad was used
    assert h.cached_tokens[-1] == 0 and h.bm.tiers.counters.disk_read_failures > 0
    assert h.bm.tiers.walk(_hashes(first)) == []


def test_pinned_slots_are_never_evicted_and_a_full_pool_refuses():
    pool = TierPool(2, "CPU")
    a, _ = pool.reserve()
    pool.store(a, b"a")
    b, _ = pool.reserve()
    pool.store(b, b"b")
    assert pool.reserve() is None  # both pinned by this plan
    pool.end_step()
    pool.lookup(b"a")  # a is now the most recent: b goes first
    assert pool.reserve() == (b, b"b")
    pool.release(b)
    pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 4), st.booleans()), min_size=1, max_size=40),
    num_host=st.integers(1, 24),
    num_disk=st.sampled_from([0, 8, 64]),
    fail_reads=st.sampled_from([0.0, 0.3]),
)
def test_random_workloads_keep_every_tier_consistent_and_every_block_comes_back(
    ops: list[tuple[int, int, bool]], num_host: int, num_disk: int, fail_reads: float
):
    h = Harness(num_blocks=12, num_host=num_host, num_disk=num_disk, fail_reads=fail_reads)
    live: list[int] = []
    for conv, turns, keep in ops:
        seq_id = h.run(_conversation(conv, turns)[: turns * 2 * BS + 1])
        if seq_id is not None:
            live.append(seq_id)
        while live and (not keep or len(live) > 2):
            h.bm.free(live.pop(0))
            h.bm.check_invariants()
    for seq_id in live:
        h.bm.free(seq_id)
    h.plan()
    assert h.bm.num_free_blocks == 12  # every GPU block back in its pool
    tiers = h.bm.tiers
    assert tiers.host.num_free + tiers.host.num_cached == num_host  # no slot left landing
    if tiers.disk is not None:
        assert tiers.disk.num_free + tiers.disk.num_cached == num_disk


def test_a_host_tier_needs_a_slot():
    with pytest.raises(ValueError):
        TierManager(0)
