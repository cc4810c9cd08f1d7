"""The client library: what programs that talk to the scheduler import (the api is one of them).

async_client.py    AsyncEngineClient: prompts checked and tokenized, submitted, streamed back; the tokenizer
                   (given, a checkpoint directory, or the one the worker announces)
connection.py      SchedulerConnection: the CURVE DEALER socket, the requests in flight, the scheduler's
                   liveness (UNAVAILABLE when it exits or stops answering)
request_stream.py  RequestHandle and what it streams: SequenceDelta, SequenceResult, RequestResult
scored_prompt.py   ScoredPrompt: a prompt's logprobs (prompt_logprobs), gathered as they arrive
detokenizer.py     incremental detokenizing, stop strings, per-token strings for logprobs
sync_client.py     EngineClient: the blocking flavour, on an event loop in a background thread
errors.py          RequestRejected (refused, invalid, or lost with the scheduler) and ClientClosed

The wire protocol itself (messages, codec, config, security) is common/'s.

    async with AsyncEngineClient("tcp://127.0.0.1:5570") as client:
        [handle] = await client.submit(["Hello"], SamplingParams(max_tokens=8))
        async for delta in handle:
            print(delta.index, delta.text, delta.finish_reason)
"""

from pagedserve.client.async_client import AsyncEngineClient, Prompt, load_tokenizer
from pagedserve.client.errors import ClientClosed, RequestRejected
from pagedserve.client.request_stream import RequestHandle, RequestResult, SequenceDelta, SequenceResult
from pagedserve.client.scored_prompt import ScoredPrompt
from pagedserve.client.sync_client import EngineClient, SyncRequestHandle

__all__ = [
    "AsyncEngineClient",
    "ClientClosed",
    "EngineClient",
    "Prompt",
    "RequestHandle",
    "RequestRejected",
    "RequestResult",
    "ScoredPrompt",
    "SequenceDelta",
    "SequenceResult",
    "SyncRequestHandle",
    "load_tokenizer",
]
