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
    client -> scheduler -> client:                KVSnapshotRequest -> KVSnapshot (the api's /dashboard)
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

import msgspec
from msgspec import Meta

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.speculative import DraftCount, DraftCounts, RunLengths

# MsgType and FinishReason are re-exported too (they were defined here)
from pagedserve.common.wire_types import (
    MAX_INT32,
    MAX_NUM_BLOCKS,
    MAX_PLAN_ITEMS,
    MAX_PROMPT_TOKENS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    BlockIds,
    BlockPairs,
    Count,
    Counts,
    ErrorKindValue,
    FinishReason,
    FinishReasonValue,
    Index,
    Int64,
    Logprob,
    MsgType,
    Name,
    NumBlocks,
    RequestId,
    Seconds,
    Seed,
    SeqBlocks,
    SeqId,
    SeqIds,
    SeqPairs,
    SeqTokens,
    Text,
    TokenId,
    TokenIds,
)
from pagedserve.common.wire_types import ErrorKind as ErrorKind  # re-exported: clients import it from here

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


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of consecutive prompt tokens of one sequence, each given the tokens before it (prompt
    scoring, `SamplingParams.prompt_logprobs`): a prefill chunk's worth, so no message holds a whole long
    prompt's."""

    start: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]  # prompt index of the first (token 0 has none)
    # one per token: its logprob and the k most likely tokens at its position, best first
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_PLAN_ITEMS)]
    # one per token: its rank in its position's distribution (1: the most likely)
    ranks: Annotated[list[Annotated[int, Meta(ge=1, le=MAX_INT32 + 1)]], Meta(max_length=MAX_PLAN_ITEMS)]


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
    # the request's next prompt logprobs, in order, each position once (an output may carry only these);
    # all of them come before the first token of any of the request's sequences
    prompt_logprobs: PromptLogprobs | None = None


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
    # "fcfs" or "priority" (--scheduling-policy): the api refuses a non-zero priority under fcfs, as vLLM does
    scheduling_policy: Annotated[str, Meta(max_length=16)] = "fcfs"
    # the server instance the scheduler belongs to (SchedulerConfig.instance_id; "" for none or an old one):
    # an api of another instance refuses it
    instance_id: Annotated[str, Meta(max_length=64)] = ""


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
    # speculative decoding (--speculative-config): the most draft tokens per sequence and step (0: off)
    num_speculative_tokens: DraftCount = 0
    sliding_window: Count = 0  # every layer slides over this many tokens or more: blocks behind go (0: none)
    # KV tiers below the pool for evicted prefix blocks (docs/kv_tiers.md): host memory slots, disk slots
    num_host_tier_blocks: NumBlocks = 0
    num_disk_tier_blocks: NumBlocks = 0
    tier_block_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0  # one block's bytes in a tier (for metrics)


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
    # how many of token_ids (at their end) were generated, before a preemption by recompute; the rest is the
    # prompt. Penalties and grammars read the generated tokens apart from the prompt.
    num_output_tokens: Count = 0


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
      1. drop `freed_seq_ids` (finished, aborted, or preempted by recompute); move the KV tiers' blocks
         (docs/kv_tiers.md): `disk_writes` host slot -> file, `tier_offloads` GPU -> host slot,
         `disk_reads` file -> host slot, `tier_loads` host slot -> GPU, in this order;
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
    # speculative decoding (docs/speculative.md): (seq_id, k) for sequences of sampling_seq_ids that compute
    # their one known token and up to k draft tokens the worker proposes, in slots the plan's blocks hold
    draft_slots: Annotated[list[tuple[SeqId, DraftCount]], Meta(max_length=MAX_PLAN_ITEMS)] = []
    # KV tiers (step 1): evicted prefix blocks down to host memory and disk, and back for a prefix hit
    disk_writes: BlockPairs = msgspec.field(default_factory=list)  # (host slot, disk slot)
    tier_offloads: BlockPairs = msgspec.field(default_factory=list)  # (gpu block, host slot)
    disk_reads: BlockPairs = msgspec.field(default_factory=list)  # (disk slot, host slot)
    tier_loads: BlockPairs = msgspec.field(default_factory=list)  # (host slot, gpu block)

    @property
    def is_noop(self) -> bool:
        """Nothing to compute and nothing to change (every field but step_id empty): the one kind of plan that
        need not reach the worker. A plan that only swaps, frees or copies must (a swap-out left unsent left
        the CPU blocks that a later swap-in reads unwritten, and the worker's freed sequences never freed)."""
        return not any(getattr(self, name) for name in self.__struct_fields__[1:])


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
    # (seq_id, the prompt logprobs its scheduled prompt tokens gave), for sequences that asked for them
    prompt_logprobs: Annotated[list[tuple[SeqId, PromptLogprobs]], Meta(max_length=MAX_PLAN_ITEMS)] = (
        msgspec.field(default_factory=list)
    )
    # sequences of seq_ids whose output constraint failed in the worker (their token is EOS): fail the request
    failed_seq_ids: SeqIds = msgspec.field(default_factory=list)
    # speculative decoding: per sequence of seq_ids, how many of token_ids (and logprobs) are its, in order
    # (1 + its accepted drafts), and how many drafts it verified; both empty when no sequence speculated
    num_tokens: RunLengths = msgspec.field(default_factory=list)
    num_drafts: DraftCounts = msgspec.field(default_factory=list)
    # host slots of the plan's disk_reads whose file was missing, corrupt, truncated or foreign (not used)
    failed_disk_reads: BlockIds = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, array_like=True):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN
    reason: Name
    # True: not an exit; forget every sequence and announce yourself again (a worker declared dead for its
    # silence, which a stopped process that continues reads first)
    reannounce: bool = False


# ---------------------------------------------------------------------------------------------------------
# client <-> scheduler: the KV pool as a picture (scheduler/snapshot.py builds it, /dashboard shows it)

MAX_SNAPSHOT_CELLS = 1 << 16  # cells of a block map: a pool larger than this groups blocks per cell
MAX_SNAPSHOT_ROWS = 1024  # requests listed in one snapshot (the rest are only counted)
MAX_ROW_RUNS = 256  # runs of block ids listed per request (for highlighting its blocks)
# Runs travel as flat lists of ints, not lists of tuples: a snapshot of thousands of runs would otherwise
# allocate thousands of tuples each time, and the garbage collector's passes cost the scheduler more than
# building them. A receiver checks a run's fields (scheduler/snapshot.py says what they are).
FlatRuns = Annotated[list[NumBlocks], Meta(max_length=3 * MAX_SNAPSHOT_CELLS)]


class KVSnapshotRequest(msgspec.Struct, array_like=True):
    """Asks for the pool's picture; the scheduler builds one only when asked, at most a few per second."""

    TYPE: ClassVar[MsgType] = MsgType.KV_SNAPSHOT_REQUEST
    query_id: Int64  # echoed in the reply
    max_cells: Annotated[int, Meta(ge=1, le=MAX_SNAPSHOT_CELLS)] = 4096  # the map's cells, at most


class KVRequestRow(msgspec.Struct, array_like=True):
    """One request's share of the pool."""

    request_id: RequestId
    state: Literal["waiting", "running", "swapped"]  # running if any sequence runs, then swapped, waiting
    num_seqs: Count  # live sequences
    num_prompt_tokens: Count
    num_output_tokens: Count  # of its longest sequence
    num_blocks: NumBlocks  # distinct GPU blocks its sequences hold
    num_shared_blocks: NumBlocks  # of which held by more than one sequence (its own or another request's)
    num_cpu_blocks: NumBlocks  # swapped out to the CPU pool
    num_cached_tokens: Count  # prompt tokens found in the prefix cache
    age_s: Seconds  # since it arrived
    # its GPU blocks as runs of consecutive ids, flat: first block id, count, first, count, ... (the first
    # MAX_ROW_RUNS runs)
    block_runs: Annotated[list[NumBlocks], Meta(max_length=2 * MAX_ROW_RUNS)]


class KVSnapshot(msgspec.Struct, array_like=True):
    """The KV pool at one moment: a run-length block map, the requests' table and the counters."""

    TYPE: ClassVar[MsgType] = MsgType.KV_SNAPSHOT
    query_id: Int64
    time_s: Annotated[float, Meta(ge=0.0, le=1e11)]  # the scheduler's wall clock (Unix seconds)
    num_blocks: NumBlocks  # the GPU pool
    block_size: Count
    blocks_per_cell: Annotated[int, Meta(ge=1, le=MAX_NUM_BLOCKS)]  # consecutive block ids per map cell
    # the map, cell by cell, as runs, flat: state, owner, length, state, owner, length, ...; state 0 free,
    # 1 cached (free, reusable), 2 in use, 3 shared; owner 1 + the row of the request holding most of the
    # cell's in-use blocks, 0 for none or an unlisted request
    cells: FlatRuns
    requests: Annotated[list[KVRequestRow], Meta(max_length=MAX_SNAPSHOT_ROWS)]
    num_requests: Count  # live requests (the table lists at most MAX_SNAPSHOT_ROWS)
    blocks_used: NumBlocks
    blocks_cached: NumBlocks
    blocks_shared: NumBlocks
    slots_allocated: Count  # slots in blocks held
    slots_used: Count  # of which hold a token's KV (the rest is waste)
    num_cpu_blocks: NumBlocks
    cpu_blocks_used: NumBlocks  # swapped-out KV
    num_running_seqs: Count
    num_waiting_seqs: Count
    num_swapped_seqs: Count
    preemptions_total: Count
    swap_outs_total: Count
    swap_ins_total: Count
    prompt_tokens_total: Count
    generated_tokens_total: Count
    # the KV tiers below the pool (docs/kv_tiers.md); 0 without them
    num_host_tier_blocks: NumBlocks = 0  # host memory's slots
    host_tier_blocks_used: NumBlocks = 0  # holding an evicted prefix block
    host_tier_hits_total: Count = 0  # blocks loaded back from host memory
    num_disk_tier_blocks: NumBlocks = 0
    disk_tier_blocks_used: NumBlocks = 0


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
    | KVSnapshotRequest
    | KVSnapshot
)

MESSAGE_CLASSES: dict[MsgType, type] = {cls.TYPE: cls for cls in get_args(Message)}

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
