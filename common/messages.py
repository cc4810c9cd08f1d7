"""Every message that crosses a process boundary.

A message travels as two ZeroMQ frames: one byte naming its type, then a msgpack array holding its fields
in declaration order. Each class spells out its own `to_wire` / `from_wire`, so the wire format is visible
here and never depends on reflection or pickle.

Processes and directions:
    client (api or a ZeroMQ user) -> scheduler: SubmitRequest, AbortRequest, InfoRequest
    scheduler -> client:                          RequestOutputs, RequestError, InfoReply
    worker -> scheduler:                          WorkerReady, StepOutput, Heartbeat
    scheduler -> worker:                          StepPlan, Shutdown
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import msgpack


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
# Sampling parameters


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of generation. Validated by `validate()` in the scheduler, for every client."""

    n: int = 1  # independent sequences per prompt
    max_tokens: int = 16  # tokens to generate per sequence, at most
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    seed: int | None = None  # same seed, same output; None draws one per request
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the sequence (it is kept)
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob and the top k
    stop: tuple[str, ...] = ()  # stop strings: applied by the client library, which sees text
    beam_width: int = 0  # 0: sample; W >= n: beam search keeping W beams, returning the n best, at the end
    length_penalty: float = 1.0  # beam search ranks finished beams by sum of logprobs / length ** this

    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_BEAM_WIDTH: ClassVar[int] = 16

    def validate(self) -> str | None:
        """Returns why these parameters are unusable, or None when they are fine."""
        if not 1 <= self.n <= 128:
            return f"n must be between 1 and 128, got {self.n}"
        if self.max_tokens < 1:
            return f"max_tokens must be at least 1, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be between 0 and 100, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be 0 (off) or positive, got {self.top_k}"
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            return f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            return f"seed must fit in 64 bits, got {self.seed}"
        if any(not s for s in self.stop):
            return "stop strings must not be empty"
        if self.beam_width:
            if not self.n <= self.beam_width <= self.MAX_BEAM_WIDTH:
                limit = self.MAX_BEAM_WIDTH
                return f"beam width must be between n ({self.n}) and {limit}, got {self.beam_width}"
            if self.temperature != 0.0:
                return "temperature must be 0 with beam search"
            if self.logprobs is not None:
                return "logprobs are not available with beam search"
        return None

    def to_wire(self) -> list[Any]:
        return [
            self.n,
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            list(self.stop_token_ids),
            self.ignore_eos,
            self.logprobs,
            list(self.stop),
            self.beam_width,
            self.length_penalty,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> SamplingParams:
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], tuple(f[6]), f[7], f[8], tuple(f[9]), f[10], f[11])


# ---------------------------------------------------------------------------------------------------------
# client <-> scheduler


@dataclass
class SubmitRequest:
    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    request_id: str  # unique per client connection; outputs and errors carry it back
    prompt_token_ids: list[int]  # used exactly as given, nothing prepended
    params: SamplingParams
    priority: int = 0  # with --scheduling-policy priority: lower runs first, ties by arrival
    cache_salt: str = ""  # mixed into the prefix-cache hash of the first block: tenants share no cache

    def to_wire(self) -> list[Any]:
        return [self.request_id, self.prompt_token_ids, self.params.to_wire(), self.priority, self.cache_salt]

    @classmethod
    def from_wire(cls, f: list[Any]) -> SubmitRequest:
        return cls(f[0], f[1], SamplingParams.from_wire(f[2]), f[3], f[4])


@dataclass
class AbortRequest:
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: str
    index: int | None = None  # one sequence of the request (a stop string hit it), or None for all
    finish_reason: str = FinishReason.ABORT  # reported for the aborted sequences

    def to_wire(self) -> list[Any]:
        return [self.request_id, self.index, self.finish_reason]

    @classmethod
    def from_wire(cls, f: list[Any]) -> AbortRequest:
        return cls(f[0], f[1], f[2])


@dataclass
class InfoRequest:
    TYPE: ClassVar[MsgType] = MsgType.INFO_REQUEST
    query_id: int  # echoed in the reply

    def to_wire(self) -> list[Any]:
        return [self.query_id]

    @classmethod
    def from_wire(cls, f: list[Any]) -> InfoRequest:
        return cls(f[0])


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token under the model's raw distribution."""

    logprob: float  # of the sampled token
    top_token_ids: list[int] = field(default_factory=list)  # the k most likely tokens, best first
    top_logprobs: list[float] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        return [self.logprob, self.top_token_ids, self.top_logprobs]

    @classmethod
    def from_wire(cls, f: list[Any]) -> TokenLogprobs:
        return cls(f[0], f[1], f[2])


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sequence of a request since its last output."""

    request_id: str
    index: int  # which of the request's n sequences
    token_ids: list[int]  # new tokens, in order
    logprobs: list[TokenLogprobs] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # set on the sequence's last output
    num_prompt_tokens: int  # for usage
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def to_wire(self) -> list[Any]:
        lp = None if self.logprobs is None else [x.to_wire() for x in self.logprobs]
        return [
            self.request_id,
            self.index,
            self.token_ids,
            lp,
            self.finish_reason,
            self.num_prompt_tokens,
            self.num_cached_tokens,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> SeqOutput:
        lp = None if f[3] is None else [TokenLogprobs.from_wire(x) for x in f[3]]
        return cls(f[0], f[1], f[2], lp, f[4], f[5], f[6])


@dataclass
class RequestOutputs:
    TYPE: ClassVar[MsgType] = MsgType.REQUEST_OUTPUTS
    outputs: list[SeqOutput]  # everything one step produced for one client

    def to_wire(self) -> list[Any]:
        return [o.to_wire() for o in self.outputs]

    @classmethod
    def from_wire(cls, f: list[Any]) -> RequestOutputs:
        return cls([SeqOutput.from_wire(o) for o in f])


@dataclass
class RequestError:
    TYPE: ClassVar[MsgType] = MsgType.REQUEST_ERROR
    request_id: str
    kind: str  # an ErrorKind value
    message: str  # for a person to read

    def to_wire(self) -> list[Any]:
        return [self.request_id, self.kind, self.message]

    @classmethod
    def from_wire(cls, f: list[Any]) -> RequestError:
        return cls(f[0], f[1], f[2])


@dataclass
class InfoReply:
    TYPE: ClassVar[MsgType] = MsgType.INFO_REPLY
    query_id: int
    ready: bool  # a worker has announced itself and requests are admitted
    model_root: str  # the checkpoint directory the worker loaded ("" before ready)
    model_name: str  # the name clients use in the "model" field
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    metrics_text: str  # the scheduler's metrics in Prometheus text format

    def to_wire(self) -> list[Any]:
        return [
            self.query_id,
            self.ready,
            self.model_root,
            self.model_name,
            self.max_model_len,
            self.vocab_size,
            self.block_size,
            self.num_kv_blocks,
            self.metrics_text,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> InfoReply:
        return cls(*f)


# ---------------------------------------------------------------------------------------------------------
# worker <-> scheduler


@dataclass
class WorkerReady:
    TYPE: ClassVar[MsgType] = MsgType.WORKER_READY
    num_kv_blocks: int  # blocks in the worker's KV pool
    block_size: int  # tokens per block
    max_model_len: int  # longest sequence (prompt + output) the worker serves
    vocab_size: int  # token ids must be below this
    eos_token_ids: list[int]  # ids that end a sequence unless ignore_eos
    model_root: str  # the checkpoint directory
    model_name: str  # served model name
    num_cpu_blocks: int = 0  # blocks in the worker's CPU swap pool (0: no swapping)
    worker_id: str = ""  # random per worker process; its heartbeats carry it ("": sends none)

    def to_wire(self) -> list[Any]:
        return [
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
            self.vocab_size,
            self.eos_token_ids,
            self.model_root,
            self.model_name,
            self.num_cpu_blocks,
            self.worker_id,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> WorkerReady:
        return cls(*f)


@dataclass
class Heartbeat:
    """The worker is alive, even in the middle of a long step. Sent from its own socket, so the scheduler's
    ROUTER sees another identity than the worker's: `worker_id` is what ties the beat to the worker."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    worker_id: str  # the WorkerReady.worker_id of the process that beats

    def to_wire(self) -> list[Any]:
        return [self.worker_id]

    @classmethod
    def from_wire(cls, f: list[Any]) -> Heartbeat:
        return cls(f[0])


@dataclass
class NewSequence:
    """A sequence the worker has not seen, or one that comes back after preemption by recompute."""

    seq_id: int
    token_ids: list[int]  # every token known so far: the prompt, then any tokens generated before preemption
    block_table: list[int]  # KV blocks allocated so far, in order
    num_computed_tokens: int  # tokens whose KV is already in the cache (always 0 in this cut)
    temperature: float
    top_p: float
    top_k: int
    seed: int  # the sequence's own seed; the worker's randomness depends only on it and the position
    num_logprobs: int  # -1: none; k >= 0: sampled token's logprob and the top k
    beam: bool = False  # a beam: report its top candidates but append nothing (the scheduler chooses)

    def to_wire(self) -> list[Any]:
        return [
            self.seq_id,
            self.token_ids,
            self.block_table,
            self.num_computed_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.num_logprobs,
            self.beam,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> NewSequence:
        return cls(*f)


@dataclass
class Fork:
    """A sequence that starts as a copy of another one, sharing its KV blocks by reference."""

    parent_seq_id: int  # must sample in the same step
    child_seq_id: int
    seed: int  # the child's own seed; its other sampling settings are the parent's

    def to_wire(self) -> list[Any]:
        return [self.parent_seq_id, self.child_seq_id, self.seed]

    @classmethod
    def from_wire(cls, f: list[Any]) -> Fork:
        return cls(f[0], f[1], f[2])


def _pairs(f: list[Any]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in f]


@dataclass
class StepPlan:
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
      7. sample one token for every sequence whose computed tokens now reach all its known tokens, and for
         every fork child from its parent's logits row.
    The scheduler mirrors rule 7, so the plan never carries tokens the worker sampled itself.
    """

    TYPE: ClassVar[MsgType] = MsgType.STEP_PLAN
    step_id: int
    freed_seq_ids: list[int]  # drop their state (applied first)
    new_seqs: list[NewSequence]
    new_block_ids: list[tuple[int, list[int]]]  # (seq_id, blocks to append to its block table)
    scheduled_seq_ids: list[int]  # the sequences that run this step, in batch order
    num_scheduled_tokens: list[int]  # per scheduled sequence
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    new_block_tables: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, whole new table)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block), GPU pool
    forks: list[Fork] = field(default_factory=list)
    clones: list[tuple[int, int]] = field(default_factory=list)  # (parent seq_id, new child seq_id)
    appended_tokens: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, token id)

    def to_wire(self) -> list[Any]:
        return [
            self.step_id,
            self.freed_seq_ids,
            [s.to_wire() for s in self.new_seqs],
            [[seq_id, blocks] for seq_id, blocks in self.new_block_ids],
            self.scheduled_seq_ids,
            self.num_scheduled_tokens,
            self.swap_out,
            self.swap_in,
            [[seq_id, table] for seq_id, table in self.new_block_tables],
            self.block_copies,
            [fork.to_wire() for fork in self.forks],
            self.clones,
            self.appended_tokens,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> StepPlan:
        return cls(
            f[0],
            f[1],
            [NewSequence.from_wire(s) for s in f[2]],
            [(seq_id, blocks) for seq_id, blocks in f[3]],
            f[4],
            f[5],
            _pairs(f[6]),
            _pairs(f[7]),
            [(seq_id, table) for seq_id, table in f[8]],
            _pairs(f[9]),
            [Fork.from_wire(x) for x in f[10]],
            _pairs(f[11]),
            _pairs(f[12]),
        )


@dataclass
class StepOutput:
    TYPE: ClassVar[MsgType] = MsgType.STEP_OUTPUT
    step_id: int  # the plan this answers
    seq_ids: list[int]  # the sequences that sampled a token this step
    token_ids: list[int]  # one per sequence in seq_ids
    logprobs: list[TokenLogprobs | None]  # one per sequence; None where it asked for none
    gpu_time_s: float = 0.0  # the step's time on the GPU (CUDA events around it; 0 off CUDA)
    # The GPU's idle time from the end of the worker's previous step to this step's start, on the GPU's
    # own clock (0 for the first step, and off CUDA)
    gpu_idle_before_s: float = 0.0

    def to_wire(self) -> list[Any]:
        return [
            self.step_id,
            self.seq_ids,
            self.token_ids,
            [None if lp is None else lp.to_wire() for lp in self.logprobs],
            self.gpu_time_s,
            self.gpu_idle_before_s,
        ]

    @classmethod
    def from_wire(cls, f: list[Any]) -> StepOutput:
        logprobs = [None if lp is None else TokenLogprobs.from_wire(lp) for lp in f[3]]
        return cls(f[0], f[1], f[2], logprobs, f[4], f[5])


@dataclass
class Shutdown:
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN
    reason: str

    def to_wire(self) -> list[Any]:
        return [self.reason]

    @classmethod
    def from_wire(cls, f: list[Any]) -> Shutdown:
        return cls(f[0])


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


class CodecError(ValueError):
    """A frame pair that is not a message of ours."""


def encode(msg: Message) -> list[bytes]:
    """The two frames for `msg`: its type byte and its msgpack-encoded fields."""
    return [bytes((msg.TYPE,)), msgpack.packb(msg.to_wire(), use_bin_type=True)]


def decode(frames: list[bytes]) -> Message:
    """The message in `frames` (type byte, payload). Raises CodecError on anything else."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise CodecError(f"expected 2 frames (type, payload), got {len(frames)}")
    try:
        cls = MESSAGE_CLASSES[MsgType(frames[0][0])]
    except ValueError as e:
        raise CodecError(f"unknown message type {frames[0][0]}") from e
    try:
        fields = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
        return cls.from_wire(fields)
    except Exception as e:  # malformed payloads from a foreign client must not kill the server
        raise CodecError(f"malformed {cls.__name__}: {e}") from e
