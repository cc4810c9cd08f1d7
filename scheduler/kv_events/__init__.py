"""KV-cache events in vLLM's wire format: what a KV-aware router (vllm-router's kv_aware, llm-d, Dynamo)
reads to learn which replica caches which prefix. Off unless --kv-events-config enables them
(docs/kv_events.md).

- `wire.py`: the event structs and their msgpack encoding, vLLM's field for field; our block hashes.
- `recorder.py`: `KVEventRecorder`, which the block manager (the only owner of the prefix-cache map) tells
  of each block it registers or evicts; it holds one step's events.
- `publisher.py`: the ZeroMQ PUB socket, sequence numbers and the replay ROUTER, on a thread of their own.
- `stream.py`: `KVEventStream`, the scheduler server's end: after each step, the recorded events go out
  as one batch.
"""
