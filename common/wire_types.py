"""The wire's field types with their ranges. A receiver may index, allocate or loop by any of these values,
so each has a bound that no honest sender reaches (common/messages.py uses them for every message)."""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Literal

from msgspec import Meta

MAX_N = 128  # sequences per prompt (SamplingParams.n)
MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_TOKENS = 1 << 20
# Blocks in a pool. The scheduler's block manager allocates ~90 bytes of bookkeeping per block of each pool
# when a worker announces itself, so this bounds what one WorkerReady can make it allocate (~1.5 GB a pool
# here, where a claim of 2**40 blocks would take all memory). It is not lower because honest pools come
# close: a tiny test model (2 KiB of KV a token, 16-token blocks) on a 141 GB GPU holds ~4M blocks in float32,
# ~8M in bfloat16. Real models need far fewer (a 0.5B Qwen2 at 12 KiB a token: 1M blocks is 192 GiB).
MAX_NUM_BLOCKS = 1 << 24
MAX_PLAN_ITEMS = 1 << 20  # entries of any one list in a StepPlan / StepOutput / RequestOutputs
MAX_TOP_LOGPROBS = 1024  # candidates reported per token (logprobs <= 20; beams ask for 2 x width <= 32)

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
# Signed or unsigned 64-bit (the worker masks it): msgpack's own int range, which msgspec cannot bound further
Seed = int
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # a non-negative 64-bit int: an id, a step, a length
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]  # below the model's vocab_size: the receiver checks that
SeqId = Count
BlockId = Annotated[int, Meta(ge=0, lt=MAX_NUM_BLOCKS)]  # below the pool's size: the receiver checks that
NumBlocks = Annotated[int, Meta(ge=0, le=MAX_NUM_BLOCKS)]
Index = Annotated[int, Meta(ge=0, lt=MAX_N)]  # one of a request's sequences
MAX_REQUEST_ID_CHARS = 256
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)]
MAX_NAME_CHARS = 4096
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]  # a model name or path, a worker id, a cache salt
Text = Annotated[str, Meta(max_length=1 << 16)]  # an error message
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]  # finite: the bounds refuse NaN and infinities too
# A logprob is at most 0; -inf is a token of probability 0 (underflow), NaN is refused by the bound.
Logprob = Annotated[float, Meta(le=0.0)]
# The sampler's temperature and top_p of one sequence; the ranges SamplingParams.validate() checks.
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=MAX_INT32)]
FinishReasonValue = Literal["stop", "length", "abort"]  # a FinishReason value
ErrorKindValue = Literal["invalid_request_error", "service_unavailable", "internal_error"]  # an ErrorKind

TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]
SeqIds = Annotated[list[SeqId], Meta(max_length=MAX_PLAN_ITEMS)]
BlockIds = Annotated[list[BlockId], Meta(max_length=MAX_PLAN_ITEMS)]
Counts = Annotated[list[Count], Meta(max_length=MAX_PLAN_ITEMS)]
BlockPairs = Annotated[list[tuple[BlockId, BlockId]], Meta(max_length=MAX_PLAN_ITEMS)]
SeqPairs = Annotated[list[tuple[SeqId, SeqId]], Meta(max_length=MAX_PLAN_ITEMS)]
SeqTokens = Annotated[list[tuple[SeqId, TokenId]], Meta(max_length=MAX_PLAN_ITEMS)]
SeqBlocks = Annotated[list[tuple[SeqId, BlockIds]], Meta(max_length=MAX_PLAN_ITEMS)]


class MsgType(IntEnum):
    SUBMIT = 1
    ABORT = 2
    INFO_REQUEST = 3
    REQUEST_OUTPUTS = 10
    REQUEST_ERROR = 11
    INFO_REPLY = 12
    WORKER_READY = 20
    STEP_OUTPUT = 21
    HEARTBEAT = 22
    STEP_PLAN = 30
    SHUTDOWN = 31
    KV_SNAPSHOT_REQUEST = 40
    KV_SNAPSHOT = 41


class ErrorKind:
    """Values of RequestError.kind (strings, so clients in any language can read them)."""

    INVALID_REQUEST = "invalid_request_error"  # the request can never be served as sent (HTTP 400)
    UNAVAILABLE = "service_unavailable"  # no worker is ready yet, or it went away (HTTP 503)
    INTERNAL = "internal_error"  # a bug on our side (HTTP 500)


class FinishReason:
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client aborted or went away
