"""Every message that crosses a process boundary.

A message travels as two ZeroMQ frames: one byte naming its type, then a msgpack array holding its fields
in declaration order (nested messages are arrays too). Each class is a `msgspec.Struct` with
`array_like=True`: its annotations are the wire format, so the format is visible here and never depends
on pickle. Decoding is typed: a payload whose fields have the wrong types, or values outside the ranges
that the `Meta` annotations below give every field, is a CodecError before any handler sees it. Ranges
that depend on the other side's state (a seq id the worker holds, a token id below this model's vocab)
are the receiver's to check.

Processes and directions:
    client (api or a ZeroMQ user) -> scheduler: SubmitRequest, AbortRequest, InfoRequest
    scheduler -> client:                          RequestOutputs, RequestError, InfoReply
    worker -> scheduler:                          WorkerReady, StepOutput, Heartbeat
    scheduler -> worker:                          StepPlan, Shutdown
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta


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


class ErrorKind:
    """Values of RequestError.kind (strings, so clients in any language can read them)."""

    INVALID_REQUEST = "invalid_request_error"  # the request can never be served as sent (HTTP 400)
    UNAVAILABLE = "service_unavailable"  # no worker is ready yet, or it went away (HTTP 503)
    INTERNAL = "internal_error"  # a bug on our side (HTTP 500)


class FinishReason:
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client aborted or went away


# ---------------------------------------------------------------------------------------------------------
# Field types with their ranges. A receiver may index, allocate or loop by any of these values, so each has
# a bound that no honest sender reaches.

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


# ---------------------------------------------------------------------------------------------------------
# Sampling parameters


class SamplingParams(msgspec.Struct, frozen=True, array_like=True):
    """What a request asks of generation. Validated by `validate()` in the scheduler, for every client; the
    decoder already refuses a field outside its own range (the `Meta` bounds), `validate()` says why in words
    for parameters built in-process and checks the rules that tie fields together."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # independent sequences per prompt
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT32)] = 16  # tokens to generate per sequence, at most
    temperature: Temperature = 1.0  # 0 means greedy
    top_p: TopP = 1.0  # nucleus mass kept, in (0, 1]
    top_k: TopK = 0  # keep the k most likely tokens; 0 keeps all
    seed: Seed | None = None  # same seed, same output; None draws one per request
    # generating one of these ends the sequence (it is kept)
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    # None: no logprobs; k >= 0: sampled token's logprob and the top k
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # stop strings: applied by the client library, which sees text
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS)] = ()
    # 0: sample; W >= n: beam search keeping W beams, returning the n best, at the end
    beam_width: Annotated[int, Meta(ge=0, le=16)] = 0
    # beam search ranks finished beams by sum of logprobs / length ** this
    length_penalty: Annotated[float, Meta(ge=-100.0, le=100.0)] = 1.0

    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_BEAM_WIDTH: ClassVar[int] = 16

    @property
    def beam(self) -> bool:  # beam search: a beam reports candidates, the scheduler chooses its tokens
        return self.beam_width > 0

    @property
    def num_logprobs(self) -> int:
        """Candidates reported per token: -1 none, else the sampled token's logprob and the top k. A beam
        asks for 2 x beam_width, so that W beams always have W unfinished continuations."""
        return 2 * self.beam_width if self.beam_width else -1 if self.logprobs is None else self.logprobs

    def validate(self) -> str | None:
        """Returns why these parameters are unusable, or None when they are fine. Every comparison is
        written so that NaN fails it."""
        if not 1 <= self.n <= MAX_N:
            return f"n must be between 1 and {MAX_N}, got {self.n}"
        if not 1 <= self.max_tokens <= MAX_INT32:
            return f"max_tokens must be between 1 and {MAX_INT32}, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be between 0 and 100, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0 <= self.top_k <= MAX_INT32:
            return f"top_k must be 0 (off) or positive, at most {MAX_INT32}, got {self.top_k}"
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            return f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            return f"seed must fit in 64 bits, got {self.seed}"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
        if any(not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            return f"stop token ids must be between 0 and {MAX_INT32}"
        if len(self.stop) > MAX_STOP_STRINGS:
            return f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
        if any(not s for s in self.stop):
            return "stop strings must not be empty"
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            return f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
        if not all(s.isascii() or _encodes(s) for s in self.stop):
            return "stop strings must be valid Unicode (a lone surrogate cannot cross the wire)"
        if not 0 <= self.beam_width <= self.MAX_BEAM_WIDTH:
            return f"beam width must be between 0 and {self.MAX_BEAM_WIDTH}, got {self.beam_width}"
        if not -100.0 <= self.length_penalty <= 100.0:
            return f"length_penalty must be between -100 and 100, got {self.length_penalty}"
        if self.beam_width:
            if not self.n <= self.beam_width:
                limit = self.MAX_BEAM_WIDTH
                return f"beam width must be between n ({self.n}) and {limit}, got {self.beam_width}"
            if self.temperature != 0.0:
                return "temperature must be 0 with beam search"
            if self.logprobs is not None:
                return "logprobs are not available with beam search"
        return None


def _encodes(text: str) -> bool:
    """Whether `text` has a UTF-8 form, as msgpack needs (JSON can carry a lone surrogate, UTF-8 cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# client <-> scheduler


class SubmitRequest(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    request_id: RequestId  # unique per client connection; outputs and errors carry it back
    prompt_token_ids: TokenIds  # used exactly as given, nothing prepended
    params: SamplingParams
    priority: Int64 = 0  # with --scheduling-policy priority: lower runs first, ties by arrival
    cache_salt: Name = ""  # mixed into the prefix-cache hash of the first block: tenants share no cache


class AbortRequest(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: RequestId
    index: Index | None = None  # one sequence of the request (a stop string hit it), or None for all
    finish_reason: FinishReasonValue = FinishReason.ABORT  # reported for the aborted sequences


class InfoRequest(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.INFO_REQUEST
    query_id: Int64  # echoed in the reply


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token under the model's raw distribution."""

    logprob: Logprob  # of the sampled token
    # the k most likely tokens, best first
    top_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOP_LOGPROBS)] = msgspec.field(
        default_factory=list
    )
    top_logprobs: Annotated[list[Logprob], Meta(max_length=MAX_TOP_LOGPROBS)] = msgspec.field(
        default_factory=list
    )


class SeqOutput(msgspec.Struct, array_like=True):
    """New tokens of one sequence of a request since its last output."""

    request_id: RequestId
    index: Index  # which of the request's n sequences
    token_ids: TokenIds  # new tokens, in order
    # one per new token when the request asked for logprobs
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_PROMPT_TOKENS)] | None
    finish_reason: FinishReasonValue | None  # set on the sequence's last output
    num_prompt_tokens: Count  # for usage
    num_cached_tokens: Count = 0  # prompt tokens served from the prefix cache


class RequestOutputs(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.REQUEST_OUTPUTS
    # everything one step produced for one client
    outputs: Annotated[list[SeqOutput], Meta(max_length=MAX_PLAN_ITEMS)]


class RequestError(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.REQUEST_ERROR
    request_id: RequestId
    kind: ErrorKindValue  # an ErrorKind value
    message: Text  # for a person to read


class InfoReply(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.INFO_REPLY
    query_id: Int64
    ready: bool  # a worker has announced itself and requests are admitted
    model_root: Name  # the checkpoint directory the worker loaded ("" before ready)
    model_name: Name  # the name clients use in the "model" field
    max_model_len: Count  # these four are 0 before ready
    vocab_size: Count
    block_size: Count
    num_kv_blocks: NumBlocks
    metrics_text: Annotated[str, Meta(max_length=1 << 24)]  # the scheduler's metrics, Prometheus text format


# ---------------------------------------------------------------------------------------------------------
# worker <-> scheduler


class WorkerReady(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_READY
    num_kv_blocks: Annotated[int, Meta(ge=1, le=MAX_NUM_BLOCKS)]  # blocks in the worker's KV pool
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]  # tokens per block
    # longest sequence (prompt + output) the worker serves
    max_model_len: Annotated[int, Meta(ge=1, le=1 << 24)]
    vocab_size: Annotated[int, Meta(ge=1, le=MAX_INT32 + 1)]  # token ids must be below this
    # ids that end a sequence unless ignore_eos
    eos_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
    model_root: Name  # the checkpoint directory
    model_name: Name  # served model name
    num_cpu_blocks: NumBlocks = 0  # blocks in the worker's CPU swap pool (0: no swapping)
    # random per worker process; its heartbeats carry it ("": sends none)
    worker_id: Annotated[str, Meta(max_length=256)] = ""
    # the batch limits the worker sized its CUDA graphs and memory profile for; the scheduler batches within
    # them (0: not known)
    max_num_seqs: Count = 0
    max_num_batched_tokens: Count = 0


class Heartbeat(msgspec.Struct, array_like=True):
    """The worker is alive, even in the middle of a long step. Sent from its own socket, so the scheduler's
    ROUTER sees another identity than the worker's: `worker_id` is what ties the beat to the worker."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    worker_id: Annotated[str, Meta(max_length=256)]  # the WorkerReady.worker_id of the process that beats


class NewSequence(msgspec.Struct, array_like=True):
    """A sequence the worker has not seen, or one that comes back after preemption by recompute."""

    seq_id: SeqId
    token_ids: TokenIds  # every token known so far: the prompt, then any tokens generated before preemption
    block_table: BlockIds  # KV blocks allocated so far, in order
    num_computed_tokens: Count  # tokens whose KV is already in the cache (a prefix-cache hit)
    # the request's parameters, whole: the worker's sampler reads its own fields from them (temperature,
    # top_p, top_k, logprobs, beam search), so a new sampling parameter crosses the wire with no new field
    params: SamplingParams
    seed: Seed  # the sequence's own seed; the worker's randomness depends only on it and the position


class Fork(msgspec.Struct, array_like=True):
    """A sequence that starts as a copy of another one, sharing its KV blocks by reference."""

    parent_seq_id: SeqId  # must sample in the same step
    child_seq_id: SeqId
    seed: Seed  # the child's own seed; its sampling parameters are the parent's


class StepPlan(msgspec.Struct, array_like=True):
    """One iteration: what to forget, move, copy and add, and how many tokens each sequence computes.

    The worker applies a plan in this order:
      0. create each of `clones` as a copy of its parent's state (beam search), then append
         `appended_tokens` (tokens the scheduler chose for beams);
      1. drop `freed_seq_ids` (finished, aborted, or preempted by recompute);
      2. copy `swap_out` blocks GPU -> CPU pool, then `swap_in` blocks CPU -> GPU, and give each sequence in
         `new_block_tables` that table (a swapped-in sequence's blocks are new);
      3. add `new_seqs`, append `new_block_ids`;
      4. copy `block_copies` (copy-on-write: src -> dst, every layer, K and V);
      5. compute, for each scheduled sequence, its next `num_scheduled_tokens` tokens starting at its
         `num_computed_tokens`;
      6. create each fork's child as a copy of its parent's state (token ids, block table, computed tokens)
         with its own seed;
      7. sample one token for every sequence in `sampling_seq_ids` (each one's computed tokens now reach
         all its known tokens), then for every fork child from its parent's logits row.
    The scheduler decides who samples and says so in the plan; the worker checks and follows it. A sampled
    token is appended by the worker itself, so no plan carries it back (docs/scheduler.md, "Who samples").
    """

    TYPE: ClassVar[MsgType] = MsgType.STEP_PLAN
    step_id: Count
    freed_seq_ids: SeqIds  # drop their state (applied first)
    new_seqs: Annotated[list[NewSequence], Meta(max_length=MAX_PLAN_ITEMS)]
    new_block_ids: SeqBlocks  # (seq_id, blocks to append to its block table)
    scheduled_seq_ids: SeqIds  # the sequences that run this step, in batch order
    num_scheduled_tokens: Counts  # per scheduled sequence
    # the scheduled sequences that sample a token this step, in batch order (a subsequence of the above)
    sampling_seq_ids: SeqIds
    swap_out: BlockPairs = msgspec.field(default_factory=list)  # (gpu block, cpu block)
    swap_in: BlockPairs = msgspec.field(default_factory=list)  # (cpu block, gpu block)
    new_block_tables: SeqBlocks = msgspec.field(default_factory=list)  # (seq_id, whole new table)
    block_copies: BlockPairs = msgspec.field(default_factory=list)  # (src block, dst block), GPU pool
    forks: Annotated[list[Fork], Meta(max_length=MAX_PLAN_ITEMS)] = msgspec.field(default_factory=list)
    clones: SeqPairs = msgspec.field(default_factory=list)  # (parent seq_id, new child seq_id)
    appended_tokens: SeqTokens = msgspec.field(default_factory=list)  # (seq_id, token id)


class StepOutput(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.STEP_OUTPUT
    step_id: Count  # the plan this answers
    seq_ids: SeqIds  # the sequences that sampled a token this step
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PLAN_ITEMS)]  # one per sequence in seq_ids
    # one per sequence; None where it asked for none
    logprobs: Annotated[list[TokenLogprobs | None], Meta(max_length=MAX_PLAN_ITEMS)]
    gpu_time_s: Seconds = 0.0  # the step's time on the GPU (CUDA events around it; 0 off CUDA)
    # The GPU's idle time from the end of the worker's previous step to this step's start, on the GPU's
    # own clock (0 for the first step, and off CUDA)
    gpu_idle_before_s: Seconds = 0.0


class Shutdown(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN
    reason: Name


Message = (
    SubmitRequest
    | AbortRequest
    | InfoRequest
    | RequestOutputs
    | RequestError
    | InfoReply
    | WorkerReady
    | Heartbeat
    | StepPlan
    | StepOutput
    | Shutdown
)

MESSAGE_CLASSES: dict[MsgType, type] = {
    cls.TYPE: cls
    for cls in (
        SubmitRequest,
        AbortRequest,
        InfoRequest,
        RequestOutputs,
        RequestError,
        InfoReply,
        WorkerReady,
        Heartbeat,
        StepPlan,
        StepOutput,
        Shutdown,
    )
}

_ENCODER = msgspec.msgpack.Encoder()
# One typed decoder per type byte, built once: msgspec compiles the checks of a type when its decoder is made.
_DECODERS: dict[int, msgspec.msgpack.Decoder] = {
    int(t): msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_CLASSES.items()
}


class CodecError(ValueError):
    """A frame pair that is not a message of ours."""


def encode(msg: Message) -> list[bytes]:
    """The two frames for `msg`: its type byte and its msgpack-encoded fields."""
    return [bytes((msg.TYPE,)), _ENCODER.encode(msg)]


def decode(frames: list[bytes]) -> Message:
    """The message in `frames` (type byte, payload), its fields of the declared types and inside their
    ranges. Raises CodecError on anything else: frames from a foreign client must not kill the server."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise CodecError(f"expected 2 frames (type, payload), got {len(frames)}")
    decoder = _DECODERS.get(frames[0][0])
    if decoder is None:
        raise CodecError(f"unknown message type {frames[0][0]}")
    try:
        return decoder.decode(frames[1])
    # Malformed msgpack, trailing bytes, a wrong type, a value off range; msgspec raises UnicodeDecodeError
    # of its own for a str that is not UTF-8 (found by scripts/fuzz_wire.py).
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:
        raise CodecError(f"malformed {MESSAGE_CLASSES[MsgType(frames[0][0])].__name__}: {e}") from e
