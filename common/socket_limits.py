"""What a ZeroMQ peer can make a process hold: every socket's largest frame (MAXMSGSIZE) and handshake time.

libzmq allocates a frame as large as its header claims as soon as it reads the header, and the CURVE
handshake's own commands go through that same decoder, before the peer has proven anything. Without a
bound, a peer without the cluster key that claimed a 500 MB frame and sent 400 MB raised the scheduler by
400 MiB, held for the 30 s default handshake timeout. With `MAXMSGSIZE` a larger claim closes the
connection before anything is allocated, so an unauthenticated connection costs at most one frame of the
receiving socket's limit, for at most `HANDSHAKE_IVL_MS`.

Each socket's limit is the largest message that its process legitimately receives (`max_message_bytes`),
worked out from the limits the process knows when it makes the socket (`WireLimits`), each message's
fields at their largest msgpack encoding. A limit a process does not know yet (the scheduler learns the
model's length from the worker, after binding) takes the wire's own bound or a ceiling below, which the
scheduler then keeps to (it batches at most UNKNOWN_MAX_NUM_SEQS sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import zmq

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_REASONING_TAG_CHARS,
    SamplingParams,
)
from pagedserve.common.wire_types import (
    MAX_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

# A CURVE handshake is three small messages: on loopback or a LAN it takes milliseconds. A peer that has
# not finished it by then is dropped (libzmq's default, 30 s, let it hold its frame that long).
HANDSHAKE_IVL_MS = 5000
# Ceilings for limits not known when the socket is made (0 in WireLimits)
UNKNOWN_MAX_NUM_SEQS = 8192  # 8 x the worker's largest automatic batch (worker/batch_limits.py)
UNKNOWN_MAX_WAITING_SEQS = 16384
UNKNOWN_DRAFT_BUDGET = 1 << 16  # SchedulerConfig.speculative_draft_budget's largest value

# The largest msgpack encodings: an int (uint64/int64), a float64, a token id (< 2**31: uint32), the header
# of a container or a string, and a string of n characters (UTF-8: 4 bytes a character at most).
INT, FLOAT, TOKEN, HEADER = 9, 9, 5, 5
SLACK = 64 * 1024  # the small fields of any message, and the type frame


def _text(chars: int) -> int:
    return HEADER + 4 * chars


def _logprobs(k: int) -> int:
    """One TokenLogprobs with k candidates."""
    return HEADER + FLOAT + 2 * HEADER + k * (TOKEN + FLOAT)


# SamplingParams with every list at its bound (the choices at their validated total): ~2.3 MiB.
SAMPLING_PARAMS_BYTES = (
    2 * _text(MAX_GRAMMAR_CHARS)  # the grammar's text, and the choices' total
    + MAX_CHOICES * HEADER
    + 2 * _text(MAX_REASONING_TAG_CHARS)
    + HEADER + MAX_ALLOWED_TOKEN_IDS * TOKEN
    + HEADER + MAX_LOGIT_BIAS * (HEADER + TOKEN + FLOAT)
    + HEADER + MAX_BAD_WORDS * (HEADER + MAX_BAD_WORD_TOKENS * TOKEN)
    + HEADER + MAX_STOP_STRINGS * _text(MAX_STOP_STRING_CHARS)
    + HEADER + MAX_STOP_TOKEN_IDS * TOKEN
    + 64 * INT  # the scalars
)  # fmt: skip
MAX_SAMPLED_TOP = 2 * SamplingParams.MAX_BEAM_WIDTH  # candidates per sampled token: 20 logprobs, 32 for beams
MAX_PROMPT_TOP = SamplingParams.MAX_LOGPROBS  # candidates per prompt token (prompt_logprobs)
INFO_REPLY_BYTES = (1 << 24) + 2 * _text(MAX_NAME_CHARS)  # its metrics text at the wire's bound
KV_SNAPSHOT_BYTES = 8 << 20  # the map's 3 x 65,536 runs and 1,024 rows of 512 runs (common/messages.py)
HEARTBEAT_SOCKET_BYTES = 4096  # the heartbeat's socket receives nothing


class Receiver(Enum):
    """A socket, named by what it receives."""

    SCHEDULER_CLIENTS = "scheduler_clients"  # SubmitRequest, AbortRequest, InfoRequest, KVSnapshotRequest
    SCHEDULER_WORKERS = "scheduler_workers"  # WorkerReady, StepOutput, Heartbeat
    WORKER = "worker"  # StepPlan, Shutdown
    CLIENT = "client"  # RequestOutputs, RequestError, InfoReply, KVSnapshot
    HEARTBEAT = "heartbeat"  # nothing


@dataclass(frozen=True)
class WireLimits:
    """The limits a receiver's largest message follows from; 0: not known (a ceiling is assumed)."""

    max_model_len: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    block_size: int = 1  # tokens per KV block (1, the worst, when not known)
    draft_budget: int | None = None  # draft tokens per step (SchedulerConfig.speculative_draft_budget)
    max_waiting_seqs: int = 0

    @classmethod
    def of_scheduler(cls, config: SchedulerConfig) -> WireLimits:
        """What the scheduler knows before a worker announces itself."""
        return cls(
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            draft_budget=config.speculative_draft_budget,
            max_waiting_seqs=config.max_waiting_seqs,
        )

    @property
    def seqs(self) -> int:
        return self.max_num_seqs or UNKNOWN_MAX_NUM_SEQS

    @property
    def tokens(self) -> int:
        return min(self.max_model_len or MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS)

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or MAX_PROMPT_TOKENS

    @property
    def blocks_per_seq(self) -> int:
        return self.tokens // self.block_size + 2


def _submit(limits: WireLimits) -> int:
    return _text(MAX_REQUEST_ID_CHARS) + HEADER + limits.tokens * TOKEN + SAMPLING_PARAMS_BYTES + SLACK


def _sampled_tokens(limits: WireLimits) -> int:
    """Tokens one step samples, at most: one per sequence, one per fork child (children are sequences
    too), and the drafts it accepts."""
    drafts = UNKNOWN_DRAFT_BUDGET if limits.draft_budget is None else limits.draft_budget
    return 2 * limits.seqs + drafts


def _step_output(limits: WireLimits) -> int:
    per_token = INT + TOKEN + _logprobs(MAX_SAMPLED_TOP) + 2 * INT  # id, token, logprobs, run lengths
    prompt = limits.batched_tokens * (_logprobs(MAX_PROMPT_TOP) + INT) + limits.seqs * (INT + 4 * HEADER)
    return _sampled_tokens(limits) * per_token + limits.seqs * INT + prompt + SLACK


def _request_outputs(limits: WireLimits) -> int:
    per_output = _text(MAX_REQUEST_ID_CHARS) + 8 * INT  # a SeqOutput's own fields
    seats = 2 * limits.seqs + (limits.max_waiting_seqs or UNKNOWN_MAX_WAITING_SEQS)  # + ends of waiting ones
    tokens = _sampled_tokens(limits) * (TOKEN + _logprobs(MAX_SAMPLED_TOP))
    prompt = limits.batched_tokens * (_logprobs(MAX_PROMPT_TOP) + INT)
    return seats * per_output + tokens + prompt + SLACK


def _step_plan(limits: WireLimits) -> int:
    """Every scheduled sequence new (its token ids, block table and parameters whole), plus every per-
    sequence list at a sequence each, and swaps and copies of whole block tables."""
    table = HEADER + limits.blocks_per_seq * TOKEN
    new_seq = HEADER + 4 * INT + HEADER + limits.tokens * TOKEN + table + SAMPLING_PARAMS_BYTES
    per_seq_lists = 12 * (INT + HEADER) + 2 * (INT + table)  # ids, counts, pairs; block appends, new tables
    block_pairs = 3 * limits.blocks_per_seq * (HEADER + 2 * TOKEN)  # swap out, swap in, copies
    return limits.seqs * (new_seq + per_seq_lists + block_pairs) + SLACK


def max_message_bytes(receiver: Receiver, limits: WireLimits = WireLimits()) -> int:
    """The largest message (its largest frame) that `receiver` legitimately gets under `limits`: the
    MAXMSGSIZE of its socket."""
    if receiver is Receiver.SCHEDULER_CLIENTS:
        return _submit(limits)
    if receiver is Receiver.SCHEDULER_WORKERS:
        return _step_output(limits)  # WorkerReady and Heartbeat are a few KiB
    if receiver is Receiver.WORKER:
        return _step_plan(limits)
    if receiver is Receiver.CLIENT:
        return max(_request_outputs(limits), INFO_REPLY_BYTES, KV_SNAPSHOT_BYTES)
    return HEARTBEAT_SOCKET_BYTES


def limit_socket(sock: zmq.Socket, max_bytes: int) -> None:
    """Bounds what a peer can make `sock` hold (before bind or connect: libzmq reads these per connection)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
