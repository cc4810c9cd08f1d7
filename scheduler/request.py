"""Requests and their sequences, as the scheduler sees them: token ids and progress, nothing else."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.common.messages import NewSequence, RequestError, SamplingParams, SeqOutput, TokenLogprobs
from pagedserve.scheduler.beam import BeamGroup

Output = tuple[bytes, SeqOutput]  # (owner, output)
Error = tuple[bytes, RequestError]  # (owner, error)


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued: never ran, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks and is scheduled each step
    SWAPPED = "swapped"  # preempted with its KV moved to the CPU pool
    FORK_PENDING = "fork_pending"  # n > 1: waits for sequence 0's prompt, to share its blocks
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One client request: a prompt and `params.n` sequences generated from it."""

    owner: bytes  # the client connection the outputs go back to (opaque to the scheduler core)
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str = ""
    order: int = 0  # arrival order among requests (its first seq_id): queue order within a priority
    seqs: list[Sequence] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # generating one ends a sequence: stop ids, and EOS unless ignored
    max_total_len: int = 0  # prompt + max_tokens, capped by max_model_len: a sequence ends at this length
    beam: BeamGroup | None = None  # beam search state, for a beam search request
    live_beams: list[Sequence] = field(default_factory=list)  # its beams still searching
    # its sequences in the waiting queue, a heap by sort key (scheduler/waiting.py), and the version of its
    # entry there
    waiting: list[tuple[tuple[int, int, int], Sequence]] = field(default_factory=list)
    queue_version: int = 0
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were sent (scheduler/prompt_logprobs.py)

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.owner, self.request_id)

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)


@dataclass(eq=False, slots=True)
class Sequence:
    """One generated sequence. `token_ids` is the prompt followed by every token generated so far."""

    seq_id: int
    request: Request
    index: int  # which of the request's n sequences
    seed: int  # the worker's randomness for this sequence depends only on it and the position
    token_ids: list[int]
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or will be once the steps in flight end)
    # Tokens this sequence samples in plans sent but not answered yet (the worker already knows them): the
    # next plan may schedule them before they arrive here. Counted in num_computed_tokens once scheduled.
    num_pending_tokens: int = 0
    num_pending_reports: int = 0  # the same for a beam: candidate reports in flight (its tokens come later)
    sort_key: tuple[int, int, int] = (0, 0, 0)  # (priority or 0, request's arrival, seq_id): queue order
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    on_worker: bool = False  # the worker holds state for it (so a free must be sent)
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    fork_children: list[Sequence] = field(default_factory=list)  # n > 1: waiting to share this prompt
    cum_logprob: float = 0.0  # beam search: summed logprob of the generated tokens
    candidates: TokenLogprobs | None = None  # beam search: next-token candidates awaiting selection

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens


class SequenceTable(dict[int, Sequence]):
    """The live sequences by seq_id, and the seq_ids given out."""

    def __init__(self) -> None:
        super().__init__()
        self._next_seq_id = 0

    def new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def add(self, seq: Sequence) -> None:
        self[seq.seq_id] = seq


def num_seqs(params: SamplingParams) -> int:
    """The sequences a request comes to have at once: n, or a beam search's width."""
    return params.beam_width or params.n


def new_sequence_message(seq: Sequence, block_table: list[int]) -> NewSequence:
    """What the worker is told of a sequence it has not seen (or that comes back to be recomputed)."""
    return NewSequence(
        seq_id=seq.seq_id,
        token_ids=list(seq.token_ids),
        block_table=list(block_table),
        num_computed_tokens=seq.num_computed_tokens,
        params=seq.request.params,
        seed=seq.seed,
        num_output_tokens=seq.num_output_tokens,
    )


def seq_output(seq: Sequence, token_ids: list[int], logprobs: list) -> SeqOutput:
    """An output of `seq` carrying `token_ids` (with their logprobs if the request asked for them)."""
    request = seq.request
    return SeqOutput(
        request.request_id,
        seq.index,
        token_ids,
        logprobs if request.params.logprobs is not None else None,
        seq.finish_reason,
        len(request.prompt_token_ids),
        max(0, seq.num_cached_tokens),
    )
