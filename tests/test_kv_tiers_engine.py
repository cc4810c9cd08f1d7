"""KV tiers through the real scheduler core and model runner (tests/engine_loop.py), against transformers.

Sixteen conversations of 4 to 6 turns, eight at a time, cycled: when a conversation comes back, fifteen
others have passed through a GPU pool of 64 blocks (256 tokens), which has long forgotten it. Each turn's
prompt is the conversation so far (every earlier prompt and transformers' greedy answer to it, then the
next user message), so every answer must equal transformers' own. With the host tier the returning turns
find their whole history below the GPU; with only the disk tier (its host memory just a staging area) they
find it on disk; with the disk files damaged they find nothing wrong, only misses.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.scheduler.kv_tiers import tiers_of
from pagedserve.worker.kv_tiers.disk import SUFFIX
from pagedserve.worker.model_runner import ModelRunner
from tests.engine_loop import EngineRun, idle, run_engine
from tests.test_engine_correctness import transformers_generate

BS = 4
MAX_TOKENS = 4
NUM_CONVERSATIONS = 16
GROUP = 8  # conversations that run at once


def _turns(c: int) -> int:
    return 4 + c % 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to split: on a loaded machine two threads per op only wait for
    each other (10x slower here). Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def conversations(tiny_model_dir) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    return make_conversations(tiny_model_dir)


def make_conversations(model_dir: Path) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """(conversation, turn) -> (its prompt, transformers' greedy answer)."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    vocab = model.config.vocab_size
    history = {c: [rng.randrange(vocab) for _ in range(6 + c % 5)] for c in range(NUM_CONVERSATIONS)}
    out = {}
    for turn in range(max(_turns(c) for c in range(NUM_CONVERSATIONS))):
        for c in range(NUM_CONVERSATIONS):
            if turn < _turns(c):
                prompt = history[c] + [rng.randrange(vocab) for _ in range(4)]
                (answer,) = transformers_generate(model, [prompt], MAX_TOKENS)
                out[(c, turn)] = (prompt, answer)
                history[c] = prompt + answer
    return out


def run_conversations(
    model_dir: Path, conversations, device: str = "cpu", **tiers
) -> tuple[EngineRun, list[tuple[int, int]]]:
    """Every turn through one scheduler and runner, `GROUP` conversations at a time, turn by turn; each
    answer checked against transformers'."""
    runner = ModelRunner(
        WorkerConfig(
            model=str(model_dir), device=device, dtype="float32", block_size=BS, num_kv_blocks=64,
            max_model_len=256, swap_space=0, **tiers,
        )
    )  # fmt: skip
    order = sorted(conversations, key=lambda key: (key[1], key[0]))  # round by round
    requests = [
        (conversations[key][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)) for key in order
    ]
    run = run_engine(
        runner,
        requests,
        pipelined=True,
        arrive=lambda run, i: i % GROUP != 0 or idle(run, i),
        max_num_seqs=GROUP,
        max_num_batched_tokens=256,
        num_host_tier_blocks=runner.kv.num_host_tier_blocks,
        num_disk_tier_blocks=runner.kv.num_disk_tier_blocks,
        tier_block_bytes=runner.kv.tier_block_bytes,
    )
    for i, key in enumerate(order):
        assert run.tokens[(i, 0)] == conversations[key][1], f"conversation {key[0]}, turn {key[1]}"
    return run, order


def _cached(run: EngineRun, i: int) -> int:
    return run.outputs[i][-1].num_cached_tokens


def _history_blocks(conversations, key: tuple[int, int]) -> int:
    """Tokens of the conversation before this turn's prompt that the prefix cache holds: whole blocks, not
    the last answer token (no step computed it), nor the block that the answer's tokens filled (registered
    only once its tokens are all known, which the sequence's end comes before)."""
    c, turn = key
    before = len(conversations[(c, turn - 1)][0]) + MAX_TOKENS - 1
    return max(0, before // BS * BS - BS)


@pytest.fixture(scope="module")
def tiers_off(tiny_model_dir, conversations):
    return run_conversations(tiny_model_dir, conversations, kv_offload_gb=0)


def test_without_tiers_the_pool_forgets_the_conversations(tiers_off, conversations):
    run, order = tiers_off
    assert tiers_of(run.scheduler.block_manager) is None
    returning = [i for i, key in enumerate(order) if key[1] > 0]
    cached = sum(_cached(run, i) for i in returning)
    assert cached < sum(_history_blocks(conversations, order[i]) for i in returning) / 4


def test_host_tier_brings_every_history_back(tiny_model_dir, conversations, tiers_off):
    run, order = run_conversations(tiny_model_dir, conversations, kv_offload_gb=0.05)
    tiers = tiers_of(run.scheduler.block_manager)
    assert tiers is not None and tiers.disk is None
    assert tiers.counters.host_hits > 0 and tiers.counters.offloads > 0
    bytes_held = tiers.metrics()["pagedserve_kv_host_tier_bytes"][0]
    assert bytes_held == tiers.host.num_cached * 2 * 4 * BS * 2 * 32 * 4  # K, V x layers x tokens x heads x D
    for i, key in enumerate(order):
        if key[1] > 0:
            assert _cached(run, i) >= _history_blocks(conversations, key), f"turn {key} missed its history"
    off = tiers_off[0]
    assert [run.tokens[(i, 0)] for i in range(len(order))] == [off.tokens[(i, 0)] for i in range(len(order))]


def test_disk_tier_alone_brings_histories_back_through_a_staging_host_tier(
    tiny_model_dir, conversations, tmp_path
):
    run, order = run_conversations(
        tiny_model_dir, conversations, kv_offload_gb=0, kv_disk_dir=str(tmp_path), kv_disk_gb=0.05
    )
    tiers = tiers_of(run.scheduler.block_manager)
    assert tiers is not None and tiers.disk is not None
    assert tiers.host.num_slots == 256 // BS  # one max-length sequence: a staging area
    assert tiers.counters.disk_writes > 0 and tiers.counters.disk_hits > 0
    assert tiers.counters.disk_read_failures == 0
    assert list(tmp_path.glob("*" + SUFFIX))
    returning = [i for i, key in enumerate(order) if key[1] > 0]
    assert (
        sum(_cached(run, i) for i in returning)
        >= sum(_history_blocks(conversations, order[i]) for i in returning) // 2
    )


def test_corrupt_disk_files_are_misses_never_used(tiny_model_dir, conversations, tmp_path, monkeypatch):
    """Every file the worker writes is damaged as soon as it is written (one flipped payload byte, or cut
    short): every disk read fails its check, is reported and costs only a miss; the answers stay exact."""
    from pagedserve.worker.kv_tiers import disk as disk_module

    write = disk_module.DiskTier.write
    damaged = []

    def write_and_damage(self, slot: int, payload: bytes) -> bool:
        ok = write(self, slot, payload)
        path = self.path(slot)
        data = bytearray(path.read_bytes())
        if len(damaged) % 2:
            data[-7] ^= 0x40
        else:
            del data[-100:]
        path.write_bytes(bytes(data))
        damaged.append(slot)
        return ok

    monkeypatch.setattr(disk_module.DiskTier, "write", write_and_damage)
    run, _ = run_conversations(
        tiny_model_dir, conversations, kv_offload_gb=0, kv_disk_dir=str(tmp_path), kv_disk_gb=0.05
    )
    tiers = tiers_of(run.scheduler.block_manager)
    assert damaged and tiers.counters.disk_read_failures > 0
    assert tiers.counters.disk_read_failures == tiers.counters.disk_hits  # not one was used
