"""The KV tiers' copies on a GPU: the side stream's offloads read a block before the step overwrites it,
loads land before the step reads them, the disk round trip keeps every byte; and the multi-turn engine
run of tests/test_kv_tiers_engine.py on CUDA (skipped without CUDA; on the device machine, `-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.messages import StepPlan
from pagedserve.scheduler.kv_tiers import tiers_of
from pagedserve.worker.kv_tiers import DiskTier, KVTiers
from tests.test_kv_tiers_engine import make_conversations, run_conversations

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _plan(step_id: int, **tier_fields) -> StepPlan:
    return StepPlan(step_id, [], [], [], [], [], [], **tier_fields)


def test_offload_then_overwrite_then_load_and_the_disk_round_trip_keep_every_byte(tmp_path):
    device = torch.device("cuda")
    shape = (4, 2, 64, 8, 16, 128)  # [L, 2, num_blocks, Hkv, block_size, D]
    pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    original = pool.clone()
    host = torch.empty((16, 4, 2, 8, 16, 128), dtype=torch.bfloat16, pin_memory=True)
    block_bytes = host[0].numel() * host.element_size()
    tiers = KVTiers(host, DiskTier(tmp_path, 8, block_bytes, b"i" * 32), device)
    blocks = list(range(10, 26))
    tiers.apply(_plan(0, tier_offloads=[(b, s) for s, b in enumerate(blocks)]), pool)
    pool.mul_(0).add_(7)  # the step's writes, queued right behind the offload on the compute stream
    for _ in range(3):  # a long queue on the compute stream, so that a missing wait would show
        torch.matmul(torch.randn(4096, 4096, device=device), torch.randn(4096, 4096, device=device))
    tiers.apply(_plan(1, disk_writes=[(0, 5), (1, 6)]), pool)
    tiers.apply(_plan(2, disk_reads=[(5, 2), (6, 3)]), pool)  # onto slots 2 and 3 (their copies are lost)
    assert tiers.take_failed(2) == []
    loads = [(s, 40 + s) for s in range(16)]
    tiers.apply(_plan(3, tier_loads=loads), pool)
    back = pool[:, :, 40:56].clone()  # read on the compute stream: after the load's wait
    torch.cuda.synchronize()
    expected = original[:, :, blocks].clone()
    expected[:, :, 2], expected[:, :, 3] = original[:, :, blocks[0]], original[:, :, blocks[1]]
    assert torch.equal(back, expected)


def test_multi_turn_conversations_on_cuda_match_transformers_with_the_host_tier(tiny_model_dir):
    conversations = make_conversations(tiny_model_dir)
    run, _ = run_conversations(tiny_model_dir, conversations, device="cuda", kv_offload_gb=0.05)
    tiers = tiers_of(run.scheduler.block_manager)
    assert tiers is not None and tiers.counters.host_hits > 0
