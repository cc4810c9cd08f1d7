"""The events as they go on the wire: vLLM's KV-cache event structs (`vllm/distributed/kv_events.py`), field
for field, in the encoding that current vLLM (since its map-encoded events) and vllm-router read.

A message is three ZeroMQ frames: the topic, the sequence number (8 bytes, big-endian, from 0), and one
msgpack `EventBatch`. The batch is positional, `[ts, events, data_parallel_rank]`; each event is a map
whose "type" key names it ("BlockStored", "BlockRemoved", "AllBlocksCleared"). Fields left at their
default are omitted, as vLLM's encoder does (`omit_defaults`).

Block hashes are our prefix-cache hashes (scheduler/block_manager.py `block_hash`: sha256 chained over the
parent's digest and the block's token ids, the first block seeded with the request's cache salt), sent as
vLLM sends its own with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: the digest's low 64 bits, an unsigned int.
They depend on nothing but the tokens (and salt), so every replica and every restart names a prefix alike.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # the pool the worker computes in (on a CPU-only machine too): vLLM's only tier here


def wire_hash(digest: bytes) -> int:
    """A block's hash as it goes on the wire: its sha256 digest's low 64 bits, as vLLM's int hashes."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One change to the prefix cache (a tagged map on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks of one sequence entered the prefix cache; block i holds token_ids[i*bs:(i+1)*bs]."""

    block_hashes: list[int]  # in order along the sequence
    parent_block_hash: int | None  # the block before the first (None: they start the sequence)
    token_ids: list[int]  # every token of these blocks, in order
    block_size: int  # tokens per block
    lora_id: int | None  # no adapters are served: always None
    medium: str | None  # "GPU"
    lora_name: str | None  # None, as lora_id
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: (cache_salt,) on a salted first
    group_idx: int | None = None  # the KV cache group: 0, the only one
    kv_cache_spec_kind: str | None = None  # not sent
    kv_cache_spec_sliding_window: int | None = None  # not sent
    locality: str | None = None  # not sent
    ownership: str | None = None  # not sent
    session_id: str | None = None  # not sent


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (their slots were taken for other content)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache: a subscriber forgets what it knew of this publisher."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one scheduler step, in the order they happened."""

    ts: float  # wall-clock seconds (time.time()) when the batch was made
    events: list[Event]
    data_parallel_rank: int | None = None  # the replica's rank (0 for a single one)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """A payload back into a batch (tests, and subscribers written in Python). msgspec.DecodeError when it
    is not one."""
    return _decoder.decode(payload)
