"""The worker's KV tiers on the CPU: block files that prove their bytes (any damage, another identity or
slot, a failed write: a miss), and a plan's tier copies moving exactly the blocks it names."""

from __future__ import annotations

import shutil

import torch

from pagedserve.common.messages import StepPlan
from pagedserve.worker.kv_tiers import DiskTier, KVTiers

BLOCK = 256  # bytes of a test block


def _disk(path, identity: bytes = b"a" * 32) -> DiskTier:
    return DiskTier(path, 4, BLOCK, identity)


def test_a_block_file_round_trips_and_any_damage_is_a_miss(tmp_path):
    disk = _disk(tmp_path)
    payload = bytes(range(256))
    assert disk.write(1, payload) and disk.read(1) == payload
    good = disk.path(1).read_bytes()
    for damaged in (good[:-1], good + b"x", good[:-3] + b"zzz", good[:20] + b"\0" + good[21:]):
        disk.path(1).write_bytes(damaged)
        disk._written.add(1)  # (as if this process had written it)
        assert disk.read(1) is None
    disk.path(1).write_bytes(good)
    disk._written.add(1)
    assert disk.read(1) == payload
    shutil.copy(disk.path(1), disk.path(2))  # another slot's file under this slot's name
    disk._written.add(2)
    assert disk.read(2) is None
    other = _disk(tmp_path / "other", identity=b"b" * 32)  # another model, config or process
    other.path(1).write_bytes(good)
    other._written.add(1)
    assert other.read(1) is None


def test_a_failed_write_is_a_miss_and_never_leaves_the_older_block(tmp_path):
    disk = _disk(tmp_path / "d")
    assert disk.write(0, b"\1" * BLOCK)
    shutil.rmtree(tmp_path / "d")  # the directory is gone: the write fails
    assert not disk.write(0, b"\2" * BLOCK)
    assert disk.read(0) is None
    assert _disk(tmp_path / "d").read(3) is None  # never written


def test_files_of_an_earlier_run_are_removed_at_start(tmp_path):
    disk = _disk(tmp_path)
    disk.write(2, b"\3" * BLOCK)
    (tmp_path / "notes.txt").write_text("mine")
    restarted = _disk(tmp_path)
    assert not list(tmp_path.glob("*.kvblock")) and (tmp_path / "notes.txt").exists()
    assert restarted.read(2) is None


def test_a_plans_tier_copies_move_exactly_the_named_blocks(tmp_path):
    pool = torch.randn(2, 2, 8, 1, 4, 8)  # [L, 2, num_blocks, Hkv, block_size, D]
    original = pool.clone()
    host = torch.zeros(4, 2, 2, 1, 4, 8)
    block_bytes = host[0].numel() * 4
    tiers = KVTiers(host, DiskTier(tmp_path, 4, block_bytes, b"i" * 32), torch.device("cpu"))
    plan = StepPlan(0, [], [], [], [], [], [], tier_offloads=[(5, 0), (6, 1)])
    tiers.apply(plan, pool)
    pool[:, :, 5:7] = 0.0  # the step overwrites the evicted blocks
    tiers.apply(StepPlan(1, [], [], [], [], [], [], disk_writes=[(0, 3)]), pool)
    tiers.disk.path(3).write_bytes(tiers.disk.path(3).read_bytes()[:-1] + b"?")  # damaged on disk
    tiers.apply(StepPlan(2, [], [], [], [], [], [], disk_reads=[(3, 2)], tier_loads=[(1, 2)]), pool)
    assert tiers.take_failed(2) == [2] and tiers.take_failed(2) == []
    assert torch.equal(pool[:, :, 2], original[:, :, 6])
    assert torch.equal(host[0], original[:, :, 5])  # block-major: [L, 2, Hkv, block_size, D]
    assert not host[2].any()  # the failed read wrote nothing
