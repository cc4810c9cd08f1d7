"""What a request's penalties, min_p, min_tokens, logit_bias, bad_words and allowed_token_ids do to its
logits row before the sampler draws from it, for the whole batch on the device.

The order is vLLM's (its v1 sampler): allowed_token_ids masks every other token; bad_words bans a word's
last token where the output ends with the rest of it; min_tokens bans EOS and stop_token_ids until that many
tokens are generated; logit_bias adds its biases; the penalties (repetition over the prompt and the output,
then OpenAI's frequency and presence over the output) apply to what that left; min_p drops the tokens less
likely than min_p times the most likely one after temperature. The sampler then applies temperature, top-k
and top-p as before. min_p is applied before temperature in logit space, where it is the same rule:
p_i / p_max < min_p  <=>  logit_i < logit_max + temperature * ln(min_p).

Logprobs stay those of the raw distribution, before any of this (worker/sampler.py `_logprobs`), as vLLM's
default (`--logprobs-mode raw_logprobs`) reports them.

Per step the host builds flat columns for the rows that ask (numpy, nothing per row on the device) and
copies them in two transfers; each processor is then a few batched tensor operations. A sequence's token
history (generated-token counts, which tokens its prompt holds, its last generated tokens) lives on the
device in `TokenHistory`, updated there from the sampled tokens, so a step's cost does not grow with the
sequences' lengths and a token still in flight (sampled by the step before, not yet on the host) counts.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedserve.common.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from pagedserve.kernels import reference_processors

TAIL = MAX_BAD_WORD_TOKENS - 1  # generated tokens kept per sequence: the longest bad word's prefix


class TrackedSeq(Protocol):
    """What the processors read of a sequence (worker/sequences.py SeqState)."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int  # token_ids[:prompt_len] is the prompt
    pending: int  # tokens sampled and not yet in token_ids
    processed: bool  # params.processed (a column read every step: the property costs ~1 us a row)


class TokenHistory:
    """The token history of the sequences that need it (penalties, multi-token bad words), one slot each,
    on the device: how often each token was generated, which tokens the prompt holds, the last TAIL tokens
    generated. A slot is filled from a sequence's tokens the first time it samples (a new sequence, one
    recomputed after a preemption, a fork child or a beam clone: none has a token in flight then) and kept
    up to date by `record` from each step's sampled tokens. A slot belongs to one SeqState object: a
    sequence recreated under the same seq id gets a new slot, and a dead one's slot is reused."""

    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=self.device)
        self.tail = torch.full((capacity, TAIL), -1, dtype=torch.int64, device=self.device)
        self._owners: list[weakref.ref | None] = [None] * capacity
        self._slot_of: dict[int, int] = {}  # id(seq) -> slot; valid while _owners[slot]() is seq
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return len(self._owners)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def slots(self, seqs: list[TrackedSeq]) -> np.ndarray:
        """Each sequence's slot [n] int64, filling the slots of those seen for the first time."""
        out = np.empty(len(seqs), dtype=np.int64)
        fresh: list[tuple[int, TrackedSeq]] = []
        for j, seq in enumerate(seqs):
            slot = self._slot_of.get(id(seq), -1)
            if slot < 0 or (owner := self._owners[slot]) is None or owner() is not seq:
                slot = self._take(seq)
                fresh.append((slot, seq))
            out[j] = slot
        if fresh:
            self._fill(fresh)
        return out

    def _take(self, seq: TrackedSeq) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._owners[slot] = weakref.ref(seq)
        self._slot_of[id(seq)] = slot
        return slot

    def _reclaim(self) -> None:
        """Frees the slots of sequences that no longer exist."""
        for slot, owner in enumerate(self._owners):
            if owner is not None and owner() is None:
                self._owners[slot] = None
                self._free.append(slot)
        self._slot_of = {k: s for k, s in self._slot_of.items() if self._owners[s] is not None}

    def _grow(self) -> None:
        old = self.capacity
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self.tail = torch.cat([self.tail, torch.full_like(self.tail, -1)])
        self._owners += [None] * old
        self._free += range(2 * old - 1, old - 1, -1)

    def _fill(self, fresh: list[tuple[int, TrackedSeq]]) -> None:
        """The slots' state from their sequences' tokens, in one transfer."""
        for _, seq in fresh:
            if seq.pending:
                raise RuntimeError("a sequence's token history was built with a token in flight")
        slots = np.array([s for s, _ in fresh], dtype=np.int64)
        prompts = [np.asarray(seq.token_ids[: seq.prompt_len], dtype=np.int64) for _, seq in fresh]
        outputs = [np.asarray(seq.token_ids[seq.prompt_len :], dtype=np.int64) for _, seq in fresh]
        tail = np.full((len(fresh), TAIL), -1, dtype=np.int64)
        for j, out in enumerate(outputs):
            last = out[-TAIL:]
            tail[j, TAIL - len(last) :] = last
        packed = _to_device(
            np.concatenate(
                [
                    slots,
                    np.repeat(slots, [len(p) for p in prompts]),
                    *prompts,
                    np.repeat(slots, [len(o) for o in outputs]),
                    *outputs,
                    tail.reshape(-1),
                ]
            ),
            self.device,
        )
        n, num_prompt = len(slots), sum(len(p) for p in prompts)
        num_out = sum(len(o) for o in outputs)
        dev_slots, rest = packed[:n], packed[n:]
        prompt_slots, prompt_ids = rest[:num_prompt], rest[num_prompt : 2 * num_prompt]
        rest = rest[2 * num_prompt :]
        out_slots, out_ids, dev_tail = rest[:num_out], rest[num_out : 2 * num_out], rest[2 * num_out :]
        self.counts.index_fill_(0, dev_slots, 0)
        self.in_prompt.index_fill_(0, dev_slots, False)
        self.in_prompt.index_put_(
            (prompt_slots, prompt_ids), torch.ones((), dtype=torch.bool, device=self.device)
        )
        ones = torch.ones(num_out, dtype=torch.int32, device=self.device)
        self.counts.index_put_((out_slots, out_ids), ones, accumulate=True)
        self.tail.index_copy_(0, dev_slots, dev_tail.view(n, TAIL))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot's sequence generated its token: slots [n] int64 (distinct), tokens [n] int64."""
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
        self.counts.index_put_((slots, tokens), ones, accumulate=True)
        tail = self.tail.index_select(0, slots)
        self.tail.index_copy_(0, slots, torch.cat([tail[:, 1:], tokens[:, None]], dim=1))


@dataclass(frozen=True)
class _Lists:
    """One request's list parameters as arrays, made once per SamplingParams object."""

    params: SamplingParams
    bias_ids: np.ndarray  # [B] logit_bias tokens
    bias_values: np.ndarray  # [B] float32
    allowed: np.ndarray  # [A] allowed_token_ids
    banned: np.ndarray  # [S] one-token bad words: always banned
    word_prefix: np.ndarray  # [W, TAIL] longer bad words' tokens but the last, right-aligned, -1 before
    word_len: np.ndarray  # [W] their prefixes' lengths
    word_last: np.ndarray  # [W] their last tokens
    stop_ids: np.ndarray  # [E] stop_token_ids and (unless ignore_eos) EOS in the vocabulary: min_tokens
    penalized: bool  # params.penalized: the sequence has a TokenHistory slot
    penalties: tuple[float, float, float]  # presence, frequency, repetition

    @classmethod
    def of(cls, p: SamplingParams, eos: tuple[int, ...], vocab_size: int) -> _Lists:
        words = [w for w in p.bad_words if len(w) > 1]
        prefix = np.full((len(words), TAIL), -1, dtype=np.int64)
        for j, w in enumerate(words):
            prefix[j, TAIL - len(w) + 1 :] = w[:-1]
        stops = {*p.stop_token_ids, *(() if p.ignore_eos else eos)}
        return cls(
            p,
            np.array([t for t, _ in p.logit_bias], dtype=np.int64),
            np.array([b for _, b in p.logit_bias], dtype=np.float32),
            np.array(p.allowed_token_ids, dtype=np.int64),
            np.array([w[0] for w in p.bad_words if len(w) == 1], dtype=np.int64),
            prefix,
            np.array([len(w) - 1 for w in words], dtype=np.int64),
            np.array([w[-1] for w in words], dtype=np.int64),
            np.array(sorted(t for t in stops if t < vocab_size), dtype=np.int64),
            p.penalized,
            (p.presence_penalty, p.frequency_penalty, p.repetition_penalty),
        )


@dataclass(frozen=True)
class ProcessorTensors:
    """One step's processor parameters on the device. Rows are logits rows; *_index index into a
    processor's own rows. Empty tensors turn a processor off."""

    history: TokenHistory | None
    allowed_rows: torch.Tensor  # [Na] rows with allowed_token_ids
    allowed_index: torch.Tensor  # [P] index into allowed_rows of each allowed token
    allowed_ids: torch.Tensor  # [P]
    ban_rows: torch.Tensor  # [K] (row, token) pairs set to -inf: one-token bad words, min_tokens' stops
    ban_ids: torch.Tensor  # [K]
    word_rows: torch.Tensor  # [W] multi-token bad words that could match: their row, slot, prefix, last
    word_slots: torch.Tensor  # [W]
    word_prefix: torch.Tensor  # [W, TAIL] -1: any token
    word_last: torch.Tensor  # [W]
    bias_rows: torch.Tensor  # [B]
    bias_ids: torch.Tensor  # [B]
    bias_values: torch.Tensor  # [B] float32
    penalty_rows: torch.Tensor  # [N] rows with penalties, their slots and the three penalties
    penalty_slots: torch.Tensor  # [N]
    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N] float32
    repetition: torch.Tensor  # [N] float32
    min_p_rows: torch.Tensor  # [M] sampling rows with min_p > 0
    min_p_shift: torch.Tensor  # [M] float32 temperature * ln(min_p): the cut below the row's max logit
    record_rows: torch.Tensor  # [H] rows whose sampled token joins their history, and their slots
    record_slots: torch.Tensor  # [H]


# The columns that name rows: when all are empty, no processor has work in the step.
_ROW_COLUMNS = (
    "allowed_rows",
    "ban_rows",
    "word_rows",
    "bias_rows",
    "penalty_rows",
    "min_p_rows",
    "record_rows",
)


class LogitsProcessors:
    """Builds each step's `ProcessorTensors` (the runner holds one, for the life of the worker)."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.history = TokenHistory(vocab_size, device)
        self._lists: dict[int, _Lists] = {}  # id(params) -> arrays, for the params of the last step

    def prepare(self, seqs: list[TrackedSeq], position: np.ndarray) -> ProcessorTensors | None:
        """The step's processors for `seqs` (one per logits row), whose next tokens are at `position`
        (len(token_ids) + pending); None when none asks for any."""
        active = np.flatnonzero(np.fromiter((s.processed for s in seqs), bool, len(seqs)))
        if not len(active):
            return None
        act = [seqs[i] for i in active]
        act_params = [s.params for s in act]
        n = len(act)
        num_generated = np.asarray(position)[active] - np.fromiter((s.prompt_len for s in act), np.int64, n)
        lists = self._lists_of(act_params)
        ints: dict[str, np.ndarray] = {}
        floats: dict[str, np.ndarray] = {}

        has_allowed = np.fromiter((len(x.allowed) > 0 for x in lists), bool, n)
        allowed = np.flatnonzero(has_allowed)
        ints["allowed_rows"] = active[allowed]
        ints["allowed_index"] = np.repeat(np.arange(len(allowed)), [len(lists[j].allowed) for j in allowed])
        ints["allowed_ids"] = _cat([lists[j].allowed for j in allowed])

        min_tokens = np.fromiter((p.min_tokens for p in act_params), np.int64, n)
        stopping = np.flatnonzero(num_generated < min_tokens)
        ban_lists = [x.banned for x in lists] + [lists[j].stop_ids for j in stopping]
        ban_rows = np.concatenate([np.arange(n), stopping])
        ints["ban_rows"] = active[np.repeat(ban_rows, [len(b) for b in ban_lists])]
        ints["ban_ids"] = _cat(ban_lists)

        penalized = np.flatnonzero(np.fromiter((x.penalized for x in lists), bool, n))
        slots = self.history.slots([act[j] for j in penalized]) if len(penalized) else penalized
        slot_of = dict(zip(penalized.tolist(), slots.tolist(), strict=True))
        word_rows, word_slots, word_prefix, word_last = [], [], [], []
        for j in penalized[np.fromiter((len(lists[j].word_len) > 0 for j in penalized), bool)]:
            fits = lists[j].word_len <= num_generated[j]  # a prefix longer than the output cannot match
            word_rows.append(np.full(int(fits.sum()), active[j]))
            word_slots.append(np.full(int(fits.sum()), slot_of[j]))
            word_prefix.append(lists[j].word_prefix[fits].reshape(-1))
            word_last.append(lists[j].word_last[fits])
        ints["word_rows"], ints["word_slots"] = _cat(word_rows), _cat(word_slots)
        ints["word_prefix"], ints["word_last"] = _cat(word_prefix), _cat(word_last)

        ints["bias_rows"] = active[np.repeat(np.arange(n), [len(x.bias_ids) for x in lists])]
        ints["bias_ids"] = _cat([x.bias_ids for x in lists])
        floats["bias_values"] = _cat([x.bias_values for x in lists], np.float32)

        values = np.array([x.penalties for x in lists], dtype=np.float32).reshape(n, 3)
        with_penalty = np.flatnonzero((values[:, 0] != 0) | (values[:, 1] != 0) | (values[:, 2] != 1))
        ints["penalty_rows"] = active[with_penalty]
        ints["penalty_slots"] = np.array([slot_of[j] for j in with_penalty.tolist()], dtype=np.int64)
        floats["presence"], floats["frequency"], floats["repetition"] = values[with_penalty].T

        min_p = np.fromiter((p.min_p for p in act_params), np.float64, n)
        temperature = np.fromiter((p.temperature for p in act_params), np.float64, n)
        cut = np.flatnonzero((min_p > 0) & (temperature > 0))  # a greedy row keeps its argmax anyway
        ints["min_p_rows"] = active[cut]
        floats["min_p_shift"] = (temperature[cut] * np.log(min_p[cut])).astype(np.float32)

        ints["record_rows"], ints["record_slots"] = active[penalized], slots
        if not any(len(ints[k]) for k in _ROW_COLUMNS):  # e.g. min_tokens reached: nothing to do this step
            return None
        return self._to_device(ints, floats)

    def _lists_of(self, params: list[SamplingParams]) -> list[_Lists]:
        """Each params' arrays, reusing the last step's: a request's lists are converted once."""
        old, new = self._lists, {}
        out = []
        for p in params:
            entry = old.get(id(p))
            if entry is None or entry.params is not p:
                entry = _Lists.of(p, self.eos, self.vocab_size)
            new[id(p)] = entry
            out.append(entry)
        self._lists = new
        return out

    def _to_device(self, ints: dict[str, np.ndarray], floats: dict[str, np.ndarray]) -> ProcessorTensors:
        """Two transfers: the int64 columns, the float32 ones."""
        dev_ints = _split(ints, np.int64, self.device)
        dev_floats = _split(floats, np.float32, self.device)
        dev_ints["word_prefix"] = dev_ints["word_prefix"].view(-1, TAIL)
        return ProcessorTensors(history=self.history, **dev_ints, **dev_floats)


def _cat(arrays: list[np.ndarray], dtype: type = np.int64) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One copy to the device that does not wait for the work queued before it (pinned, non-blocking)."""
    host = torch.from_numpy(array)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _split(columns: dict[str, np.ndarray], dtype: type, device: torch.device) -> dict[str, torch.Tensor]:
    packed = _to_device(np.concatenate([np.asarray(c, dtype=dtype) for c in columns.values()]), device)
    out, start = {}, 0
    for name, column in columns.items():
        out[name] = packed[start : start + len(column)]
        start += len(column)
    return out


def apply_processors(logits: torch.Tensor, pt: ProcessorTensors) -> torch.Tensor:
    """The processed logits ([R, V] float32, a new tensor: `logits` stays raw for the logprobs)."""
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    vocab = out.shape[-1]
    neg_inf = torch.full((), float("-inf"), device=out.device)  # a fill on the device, not a host copy
    if len(pt.allowed_rows):
        blocked = torch.ones((len(pt.allowed_rows), vocab), dtype=torch.bool, device=out.device)
        blocked.index_put_(
            (pt.allowed_index, pt.allowed_ids), torch.zeros((), dtype=torch.bool, device=out.device)
        )
        rows = out.index_select(0, pt.allowed_rows).masked_fill_(blocked, float("-inf"))
        out.index_copy_(0, pt.allowed_rows, rows)
    if len(pt.word_rows) and pt.history is not None:
        tail = pt.history.tail.index_select(0, pt.word_slots)  # [W, TAIL]
        match = ((tail == pt.word_prefix) | (pt.word_prefix < 0)).all(dim=-1)
        # accumulate: -inf where a word matches, 0 elsewhere, whatever other words share its last token
        out.index_put_((pt.word_rows, pt.word_last), torch.where(match, neg_inf, 0.0), accumulate=True)
    if len(pt.ban_rows):
        out.index_put_((pt.ban_rows, pt.ban_ids), neg_inf)
    if len(pt.bias_rows):
        out.index_put_((pt.bias_rows, pt.bias_ids), pt.bias_values, accumulate=True)
    # The penalties and min_p pass over the whole vocabulary: one Triton launch each on a GPU.
    rules = reference_processors
    if out.is_cuda:
        from pagedserve.kernels import processors as rules
    if len(pt.penalty_rows) and pt.history is not None:
        history = pt.history
        rules.penalize_(
            out, pt.penalty_rows, pt.penalty_slots, history.counts, history.in_prompt,
            pt.presence, pt.frequency, pt.repetition,
        )  # fmt: skip
    if len(pt.min_p_rows):
        rules.min_p_(out, pt.min_p_rows, pt.min_p_shift)
    return out


def record_sampled(tokens: torch.Tensor, pt: ProcessorTensors) -> None:
    """The step's sampled tokens ([R] int64, on the device) join their sequences' histories."""
    if len(pt.record_rows) and pt.history is not None:
        pt.history.record(pt.record_slots, tokens.index_select(0, pt.record_rows))
