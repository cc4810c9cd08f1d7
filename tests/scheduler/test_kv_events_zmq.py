"""KV events over ZeroMQ: the scheduler core (fake worker) publishing through `KVEventStream`, received on a
SUB socket and decoded with vLLM's definitions; sequence numbers, replay of a missed range, the bounded
buffer and queue."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import zmq

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.kv_events_config import KVEventsConfig, endpoint_for_rank
from pagedserve.scheduler.kv_events.publisher import ZmqEventPublisher, binds
from pagedserve.scheduler.kv_events.stream import KVEventStream
from pagedserve.scheduler.kv_events.wire import AllBlocksCleared, EventBatch
from scripts._servers import free_port
from tests.scheduler import vllm_kv_events as vllm
from tests.scheduler.conftest import make_harness

TIMEOUT_MS = 5000


def _config(**kw) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic="kv-events",
        **kw,
    )


def _subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"kv-events") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def _until_subscribed(publisher: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """PUB drops what it sends before a subscription arrives: probe until one gets through. Returns the
    sequence number the probes reached."""
    for _ in range(200):
        publisher.publish(EventBatch(0.0, [AllBlocksCleared()], 0))
        if sub.poll(20):
            while sub.poll(100):
                seq = int.from_bytes(sub.recv_multipart()[1], "big")
            return seq + 1
    raise AssertionError("the subscription never arrived")


def _replay(
    ctx: zmq.Context, endpoint: str, start: int, topic: bytes = b"kv-events"
) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answer = []
    while True:
        first, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert first == payload == b""  # the end: empty topic and payload
            dealer.close()
            return answer
        assert first == topic  # a batch: the live message's frames
        answer.append((int.from_bytes(seq, "big"), payload))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_scheduler_publishes_each_step_and_replays_a_missed_range(ctx: zmq.Context):
    config = _config()
    stream = KVEventStream(
        SchedulerConfig(kv_events_config=json.dumps(dataclasses.asdict(config)), data_parallel_rank=0)
    )
    stream.start()
    try:
        publisher = stream.publisher
        assert isinstance(publisher, ZmqEventPublisher)
        sub = _subscribe(ctx, config.endpoint)
        first = _until_subscribed(publisher, sub)
        h = make_harness(num_blocks=12, block_size=4, max_num_seqs=2, kv_events=True)
        for i in range(10):
            h.submit(f"r{i}", [i * 100 + t for t in range(13)], max_tokens=8)
        while h.busy:
            h.step()
            stream.after_step(h.scheduler)
        received = []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            received.append((int.from_bytes(seq, "big"), payload))
        seqs = [s for s, _ in received]
        assert seqs == list(range(first, first + len(seqs))) and len(seqs) >= 8  # per step, in order
        events = [e for _, p in received for e in vllm.DECODER.decode(p).events]
        assert isinstance(events[0], vllm.AllBlocksCleared)  # the new core's pool
        stored = [e for e in events if isinstance(e, vllm.BlockStored)]
        removed = [h for e in events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes]
        assert len(stored) >= 10 and removed  # every prompt stored, the small pool evicted
        assert all(vllm.DECODER.decode(p).data_parallel_rank == 0 for _, p in received)
        # A subscriber that missed everything from seqs[3] on asks for it: the same bytes come back.
        assert _replay(ctx, config.replay_endpoint, seqs[3]) == received[3:]
        assert _replay(ctx, config.replay_endpoint, seqs[-1] + 1) == []  # nothing newer: just the end
        stream.cleared()  # the worker died: its pool is gone at once
        topic, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == seqs[-1] + 1
        assert [type(e) for e in vllm.DECODER.decode(payload).events] == [vllm.AllBlocksCleared]
        assert stream.publisher.dropped == 0
        assert "pagedserve_kv_events_batches_published_total" in stream.metrics_text()
    finally:
        stream.close()


def test_replay_keeps_only_the_last_buffer_steps_and_survives_bad_requests(ctx: zmq.Context):
    config = _config(buffer_steps=3)
    publisher = ZmqEventPublisher(config)
    try:
        for _ in range(5):
            publisher.publish(EventBatch(1.0, [AllBlocksCleared()], 0))
        deadline = time.monotonic() + 5
        while publisher.published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(config.replay_endpoint)
        raw.send_multipart([b"", b"\x00\x01"])  # a sequence number of 2 bytes: dropped, unanswered
        raw.send_multipart([b"x", b"y", b"z"])  # garbage
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(config.replay_endpoint)
        big.send_multipart([b"", b"\x00" * (1 << 20)])  # past MAXMSGSIZE: its connection is dropped
        assert [s for s, _ in _replay(ctx, config.replay_endpoint, 0)] == [2, 3, 4]
        raw.close()
        big.close()
    finally:
        publisher.close()


def test_a_full_queue_drops_batches_and_counts_them():
    publisher = ZmqEventPublisher(_config(max_queue_size=1))
    batch = EventBatch(1.0, [AllBlocksCleared()], 0)
    try:
        for _ in range(2000):
            publisher.publish(batch)
    finally:
        publisher.close()
    assert publisher.dropped > 0 and publisher.published + publisher.dropped == 2000


def test_endpoints_bind_loopback_and_wildcards_and_offset_by_rank():
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://*:5557") and binds("ipc:///tmp/kv")
    assert binds("tcp://localhost:5557") and binds("tcp://[::1]:5557") and binds("tcp://0.0.0.0:5557")
    assert not binds("tcp://10.0.0.5:5557")  # vLLM's rule: a named host is connected to
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert endpoint_for_rank("inproc://kv", 1) == "inproc://kv_dp1"


def test_a_taken_port_fails_at_start(ctx: zmq.Context):
    config = _config()
    squatter = ctx.socket(zmq.PUB)
    squatter.bind(config.endpoint)
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(config)
    squatter.close()
