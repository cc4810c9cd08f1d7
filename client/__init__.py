"""The client library: what programs that talk to the scheduler import (the api is one of them)."""

from client.async_client import (
    AsyncEngineClient,
    ClientClosed,
    EngineClient,
    Prompt,
    RequestHandle,
    RequestRejected,
    RequestResult,
    SequenceDelta,
    SequenceResult,
    SyncRequestHandle,
    load_tokenizer,
)

__all__ = [
    "AsyncEngineClient",
    "ClientClosed",
    "EngineClient",
    "Prompt",
    "RequestHandle",
    "RequestRejected",
    "RequestResult",
    "SequenceDelta",
    "SequenceResult",
    "SyncRequestHandle",
    "load_tokenizer",
]
