"""KV-cache events: the block manager's hook, the recorder, and what a vLLM consumer decodes from the core
run with a fake worker (no sockets here; tests/scheduler/test_kv_events_zmq.py has the ZeroMQ side)."""

from __future__ import annotations

import random
import subprocess
import sys

import msgspec
import pytest

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.kv_events_config import KVEventsConfig, kv_events_enabled, parse_kv_events_config
from pagedserve.scheduler.block_manager import block_hash
from pagedserve.scheduler.kv_events.recorder import MAX_PENDING, KVEventRecorder
from pagedserve.scheduler.kv_events.wire import EventBatch, encode_batch, wire_hash
from tests.scheduler import vllm_kv_events as vllm
from tests.scheduler.conftest import Harness, make_harness


def _decode(h: Harness) -> list[vllm.BlockStored | vllm.BlockRemoved | vllm.AllBlocksCleared]:
    """The events recorded since the last call, through our encoder and vLLM's decoder."""
    assert h.scheduler.kv_events is not None
    events = h.scheduler.kv_events.take()
    payload = encode_batch(EventBatch(1.0, events, 0))
    batch = vllm.DECODER.decode(payload)
    assert batch.data_parallel_rank == 0 and batch.ts == 1.0
    return batch.events


def _run(h: Harness) -> list:
    events = []
    while h.busy:
        h.step()
        events += _decode(h)
    return events


def _hashes(tokens: list[int], block_size: int, salt: str = "") -> list[int]:
    digests: list[bytes] = []
    for i in range(len(tokens) // block_size):
        digests.append(
            block_hash(digests[-1] if digests else None, tokens[i * block_size : (i + 1) * block_size], salt)
        )
    return [wire_hash(d) for d in digests]


def test_config_takes_vllm_json_and_refuses_unknown_or_mistyped_keys():
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9, "topic": "kv"}'
    )
    assert config == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 5, 7, 9, "kv")
    assert parse_kv_events_config("") is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').resolved_publisher == "zmq"
    assert parse_kv_events_config('{"publisher": "zmq"}').resolved_publisher == "null"  # not enabled
    assert parse_kv_events_config("{}").endpoint == "tcp://127.0.0.1:5557"  # loopback unless told
    assert not kv_events_enabled("") and kv_events_enabled('{"enable_kv_cache_events": true}')
    for bad in (
        '{"enable_kv_cache_events": 1}', '{"endpont": "tcp://*:1"}', '{"hwm": 0}', '{"publisher": "kafka"}',
        '{"endpoint": "http://x"}', "[1]", "{not json", '{"buffer_steps": true}',
    ):  # fmt: skip
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)
    with pytest.raises(ValueError, match="endpont"):
        SchedulerConfig(kv_events_config='{"endpont": "tcp://*:1"}')


def test_events_are_off_unless_enabled():
    assert make_harness().scheduler.kv_events is None


def test_a_prompt_stores_its_full_blocks_chained_from_none():
    h = make_harness(block_size=4, kv_events=True)
    prompt = list(range(100, 110))  # two full blocks and two tokens
    h.submit("a", prompt, max_tokens=1)
    events = _run(h)
    assert isinstance(events[0], vllm.AllBlocksCleared)  # a new pool: forget what an earlier one said
    stored = [e for e in events if isinstance(e, vllm.BlockStored)]
    assert len(stored) == 1
    (e,) = stored
    assert e.block_hashes == _hashes(prompt, 4) and e.parent_block_hash is None
    assert e.token_ids == prompt[:8] and e.block_size == 4
    assert (e.lora_id, e.medium, e.lora_name, e.group_idx, e.extra_keys) == (None, "GPU", None, 0, None)


def test_a_shared_prefix_chains_the_new_blocks_to_the_cached_parent():
    h = make_harness(block_size=4, kv_events=True)
    first = list(range(12))  # three blocks
    h.submit("a", first + [99], max_tokens=1)
    _run(h)
    second = first[:8] + [50, 51, 52, 53, 54]  # shares two blocks, then a new one
    h.submit("b", second, max_tokens=1)
    stored = [e for e in _run(h) if isinstance(e, vllm.BlockStored)]
    assert len(stored) == 1
    assert stored[0].parent_block_hash == _hashes(first, 4)[1]
    assert stored[0].block_hashes == _hashes(second, 4)[2:3] and stored[0].token_ids == second[8:12]


def test_a_salted_first_block_says_so_and_hashes_apart():
    h = make_harness(block_size=4, kv_events=True)
    prompt = list(range(9))
    h.scheduler.add_request(b"c", _submit("s", prompt, cache_salt="tenant-a"))
    (e,) = [e for e in _run(h) if isinstance(e, vllm.BlockStored)]
    assert e.extra_keys == [("tenant-a",), None]
    assert e.block_hashes == _hashes(prompt, 4, "tenant-a") != _hashes(prompt, 4)


def _submit(request_id: str, prompt: list[int], cache_salt: str = ""):
    from pagedserve.common.messages import SamplingParams, SubmitRequest

    return SubmitRequest(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=cache_salt)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_consumer_replaying_the_events_knows_exactly_what_is_cached(pipelined: bool):
    """Under eviction pressure (a small pool, shared and distinct prefixes, decode blocks), a subscriber that
    applies every event holds exactly the block manager's prefix cache after every step, and every parent it
    is told of is a block it was told was stored."""
    h = make_harness(num_blocks=24, block_size=4, max_num_seqs=4, kv_events=True, pipelined=pipelined)
    rng = random.Random(7)
    system = [rng.randrange(1000) for _ in range(8)]
    for i in range(30):
        tail = [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
        h.submit(f"r{i}", (system if i % 2 else []) + tail, max_tokens=rng.randint(1, 9))
    known: set[int] = set()
    removed = stored = 0
    while h.busy:
        h.step()
        for e in _decode(h):
            if isinstance(e, vllm.AllBlocksCleared):
                known.clear()
            elif isinstance(e, vllm.BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in known
                assert not known & set(e.block_hashes), "a block stored twice"
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                known |= set(e.block_hashes)
                stored += len(e.block_hashes)
            else:
                assert set(e.block_hashes) <= known, "a block removed that was never stored"
                known -= set(e.block_hashes)
                removed += len(e.block_hashes)
        cached = {wire_hash(d) for d in h.scheduler.block_manager._cached}
        assert known == cached
    assert removed > 10 and stored > removed  # the pool was too small to keep everything


def test_pending_events_are_bounded_by_one_clear():
    recorder = KVEventRecorder(block_size=1)
    recorder.take()  # the first AllBlocksCleared
    digest = block_hash(None, [1])
    for _ in range(MAX_PENDING // 2):
        recorder.stored([digest, digest], [0, 1], [1, 1], "")
    for _ in range(5):  # past the bound: everything pending is replaced by one clear, then these
        recorder.removed(digest)
    events = recorder.take()
    assert recorder.overflows == 1 and [type(e).__name__ for e in events] == [
        "AllBlocksCleared",
        "BlockRemoved",
    ]
    assert len(events[1].block_hashes) == 5
    assert recorder.take() == []


def test_block_hashes_are_the_same_in_every_process():
    """A router matches prefixes across replicas: the same tokens must hash alike in another process (not
    Python's per-process hash())."""
    code = (
        "from pagedserve.scheduler.block_manager import block_hash;"
        "from pagedserve.scheduler.kv_events.wire import wire_hash;"
        "a = block_hash(None, [1, 2, 3], 'salt'); print(wire_hash(block_hash(a, [4, 5, 6])))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    first = block_hash(None, [1, 2, 3], "salt")
    assert outputs == {str(wire_hash(block_hash(first, [4, 5, 6])))}


def test_events_encode_as_vllm_sends_them():
    """The bytes: a positional batch of tagged maps, defaults left out (what vllm-router's decoder reads)."""
    recorder = KVEventRecorder(block_size=2)
    recorder.take()
    recorder.stored([block_hash(None, [1, 2])], [0], [1, 2], "")
    recorder.removed(block_hash(None, [1, 2]))
    raw = msgspec.msgpack.decode(encode_batch(EventBatch(2.5, recorder.take(), 3)))
    h = wire_hash(block_hash(None, [1, 2]))
    assert raw == [
        2.5,
        [
            {
                "type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0},
        ],
        3,
    ]  # fmt: skip
