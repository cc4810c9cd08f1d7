"""Picks the next token of each sampling sequence from its logits row, and reports logprobs.

Reproducibility: a sequence's draw depends only on its logits, its own parameters, its seed and the index of
the token being sampled, never on its batch-mates or its history. Each row draws by inverse-CDF sampling with
one uniform number hashed from (seed, position), and the order in which it accumulates probability is fixed
by its own parameters alone. A sequence preempted and recomputed, or batched differently, draws the same
token (up to the float noise of the logits themselves).

The whole batch is sampled on the device, with one host-to-device copy of the parameters and one
device-to-host copy of the results per step. The host sorts rows into draw groups by their parameters alone
(greedy; plain softmax over the vocabulary; top-k among a candidate set whose width is a power of two fixed by
the row's top_k; a full sort for top-p without top-k, or top_k above 4096), so every tensor a row passes
through has a shape that depends on its own parameters, not on its batch-mates':

    tensors = SamplingTensors.from_params(params, seed, position, device)   # before the forward pass
    copy = sample_tensors(logits, tensors).start_copy()  # queued on the device, nothing waits
    tokens, logprobs = copy.wait()
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from pagedserve.common.messages import SamplingParams, TokenLogprobs
from pagedserve.worker.logits_processors import ProcessorTensors, apply_processors, record_sampled
from pagedserve.worker.masked_rows import masked_rows, pack_flags, unpack_flags
from pagedserve.worker.nucleus_draw import device_round_uniforms, draw_nucleus_into
from pagedserve.worker.structured import TokenBitmask, apply_token_bitmask
from pagedserve.worker.uniforms import MASK64, uniform_for, uniforms_for  # noqa: F401 (uniform_for: imported from here)

_MIN_TOP_K_WIDTH = 64  # narrower candidate sets save nothing on a GPU, and 64 columns reduce like wider ones
_MAX_TOP_K_WIDTH = 4096  # rows with a larger top_k take the full sort


@dataclass(frozen=True)
class SamplingRow:
    """One sampling sequence as the sampler sees it: its request's parameters, its seed, and the index of the
    token being sampled (tests and benchmarks; the runner passes the same as columns to `from_params`)."""

    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled within its sequence

    @property
    def temperature(self) -> float:  # 0: greedy
        return self.params.temperature

    @property
    def top_k(self) -> int:  # 0: off
        return self.params.top_k

    @property
    def top_p(self) -> float:  # 1.0: off
        return self.params.top_p

    @property
    def num_logprobs(self) -> int:  # -1: none; k >= 0: sampled token's logprob and the top k
        return self.params.num_logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True)
class DrawGroup:
    """Consecutive slots of a `SamplingTensors` that draw the same way."""

    kind: Literal["plain", "top_k", "sorted"]  # vocabulary order; `width` best candidates; full sort
    start: int  # first slot
    end: int  # one past the last slot
    width: int = 0  # top_k: how many candidates, a power of two >= each row's top_k


@dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling parameters on the device (left on the host when no row needs them there), and
    what the host knows of them, so that branches are taken without looking at the device. Rows are stored
    in slot order: `order[j]` is the logits row of slot j, and the slots of each draw group are consecutive,
    so that a group's parameters are plain slices."""

    num_rows: int
    order: torch.Tensor  # [R] int64: logits row of each slot
    temperature: torch.Tensor  # [R] float32, by slot
    top_k: torch.Tensor  # [R] int64, by slot
    top_p: torch.Tensor  # [R] float32, by slot
    uniforms: torch.Tensor  # [R] float64, uniform_for(seed, position) by slot; empty when all are greedy
    groups: tuple[DrawGroup, ...]  # the slots that draw at random; none when all rows are greedy
    any_greedy: bool
    logprob_rows: torch.Tensor  # [L] int64: the rows that asked for logprobs
    logprob_rows_host: np.ndarray  # [L] the same, on the host
    num_logprobs: np.ndarray  # [L] how many top logprobs each of them asked for
    processors: ProcessorTensors | None = None  # penalties, min_p, ... (worker/logits_processors.py)
    token_bitmask: TokenBitmask | None = None  # structured output: what each constrained row may draw
    round_uniforms: torch.Tensor | None = None  # [R, rounds + 1] float64: top-p draws on CUDA (nucleus_draw)

    @property
    def all_greedy(self) -> bool:  # then sampling is one argmax
        return not self.groups

    @property
    def max_num_logprobs(self) -> int:  # -1 when no row asked
        return int(self.num_logprobs.max()) if len(self.num_logprobs) else -1

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], device: torch.device | str) -> SamplingTensors:
        return cls.from_params(
            [r.params for r in rows],
            seed=np.array([r.seed & MASK64 for r in rows], dtype=np.uint64),
            position=np.array([r.position for r in rows], dtype=np.int64),
            device=device,
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],  # [R] each row's request parameters
        seed: np.ndarray,  # [R] uint64, or int64 holding the same bits
        position: np.ndarray,  # [R] index of the token being sampled
        device: torch.device | str,
        processors: ProcessorTensors | None = None,  # LogitsProcessors.prepare of the same rows
    ) -> SamplingTensors:
        """The rows' parameters as columns (one pass per field, no object per row: it runs every step).
        A new sampling parameter is read here from SamplingParams and applied in `sample_tensors`."""
        n = len(params)
        tensors = cls.from_arrays(
            temperature=np.fromiter((p.temperature for p in params), np.float64, n),
            top_k=np.fromiter((p.top_k for p in params), np.int64, n),
            top_p=np.fromiter((p.top_p for p in params), np.float64, n),
            seed=seed,
            position=position,
            num_logprobs=np.fromiter((p.num_logprobs for p in params), np.int64, n),
            device=device,
        )
        return tensors if processors is None else replace(tensors, processors=processors)

    @classmethod
    def from_arrays(
        cls,
        temperature: np.ndarray,  # [R] 0: greedy
        top_k: np.ndarray,  # [R] 0: off
        top_p: np.ndarray,  # [R] 1.0: off
        seed: np.ndarray,  # [R] uint64, or int64 holding the same bits
        position: np.ndarray,  # [R] index of the token being sampled
        num_logprobs: np.ndarray,  # [R] -1: none
        device: torch.device | str,
    ) -> SamplingTensors:
        """Groups the rows on the host and copies their parameters to `device` in one transfer."""
        device = torch.device(device)
        num_rows = len(temperature)
        top_k = np.asarray(top_k, dtype=np.int64)
        greedy = np.asarray(temperature) == 0.0
        filtered = (top_k > 0) | (np.asarray(top_p) < 1.0)
        k = np.clip(top_k, 1, 1 << 40).astype(np.float64)
        width = np.maximum(_MIN_TOP_K_WIDTH, 2 ** np.ceil(np.log2(k))).astype(np.int64)
        by_top_k = (top_k > 0) & (width <= _MAX_TOP_K_WIDTH)
        # Group keys: 0 greedy, 1 plain, 2 sorted, width + 2 top-k (width >= 64).
        key = np.select([greedy, ~filtered, by_top_k], [0, 1, width + 2], default=2)
        order = np.argsort(key, kind="stable")
        keys, starts = np.unique(key[order], return_index=True)
        ends = [*starts[1:].tolist(), num_rows]
        groups = []
        for g, start, end in zip(keys.tolist(), starts.tolist(), ends, strict=True):
            if g == 1:
                groups.append(DrawGroup("plain", start, end))
            elif g == 2:
                groups.append(DrawGroup("sorted", start, end))
            elif g > 2:
                groups.append(DrawGroup("top_k", start, end, width=g - 2))

        num_logprobs = np.asarray(num_logprobs, dtype=np.int64)
        logprob_rows = np.flatnonzero(num_logprobs >= 0)
        # The draws' uniform numbers are hashed here, on the host, and travel with the rest.
        uniforms = uniforms_for(np.asarray(seed)[order], np.asarray(position)[order]) if groups else None
        params = np.stack(
            [
                order,
                np.zeros(num_rows, dtype=np.int64) if uniforms is None else uniforms.view(np.int64),
                top_k[order],
                np.asarray(temperature, dtype=np.float32)[order].view(np.int32).astype(np.int64),
                np.asarray(top_p, dtype=np.float32)[order].view(np.int32).astype(np.int64),
            ]
        ).reshape(-1)
        packed = torch.from_numpy(np.concatenate([params, logprob_rows]))
        # An all-greedy step without logprobs is an argmax that reads none of this: it stays on the host.
        if groups or len(logprob_rows):
            if device.type == "cuda":
                packed = packed.pin_memory().to(device, non_blocking=True)
            else:
                packed = packed.to(device)
        fields = packed[: 5 * num_rows].view(5, num_rows)
        return cls(
            num_rows=num_rows,
            order=fields[0],
            temperature=fields[3].to(torch.int32).view(torch.float32),
            top_k=fields[2],
            top_p=fields[4].to(torch.int32).view(torch.float32),
            uniforms=fields[1].view(torch.float64) if groups else fields[1][:0].view(torch.float64),
            groups=tuple(groups),
            any_greedy=bool(greedy.any()),
            logprob_rows=packed[5 * num_rows :],
            logprob_rows_host=logprob_rows,
            num_logprobs=num_logprobs[logprob_rows],
            round_uniforms=device_round_uniforms(uniforms_for, groups, seed, position, order, device),
        )


@dataclass(frozen=True)
class SamplerOutput:
    """One step's results, still on the device (nothing has waited for them)."""

    tokens: torch.Tensor  # [R] int64
    chosen_logprobs: torch.Tensor | None  # [L] float32: each logprob row's sampled token; None when L = 0
    top_ids: torch.Tensor | None  # [L, K] int64, best first, K the largest num_logprobs; None when K <= 0
    top_logprobs: torch.Tensor | None  # [L, K] float32
    logprob_rows: np.ndarray  # [L] rows that asked for logprobs
    num_logprobs: np.ndarray  # [L] how many of the K each of them asked for
    masked: torch.Tensor | None = None  # [R] bool: rows with nothing left to draw (worker/masked_rows.py)

    def start_copy(self) -> SamplerCopy:
        """Starts the one device-to-host transfer of everything (into pinned memory on CUDA)."""
        parts = [self.tokens]
        if self.chosen_logprobs is not None:
            parts = [self.tokens, self.chosen_logprobs]
            if self.top_ids is not None and self.top_logprobs is not None:
                parts += [self.top_ids.flatten(), self.top_logprobs.flatten()]
            # float64 holds token ids (< 2**53) and float32 logprobs exactly.
            packed = torch.cat([p.double() for p in parts])
        else:
            packed = self.tokens
        packed = pack_flags(packed, self.masked)  # (the flags ride along: no transfer of their own)
        ready = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = packed
        flagged = self.masked is not None
        return SamplerCopy(host, ready, len(self.tokens), self.logprob_rows, self.num_logprobs, flagged)


@dataclass(frozen=True)
class SamplerCopy:
    """The results on their way to the host; `wait` blocks until they arrive and unpacks them."""

    host: torch.Tensor  # [R] int64 tokens, or float64 [R + L + 2 L K]: tokens, chosen, top ids, top logprobs
    ready: torch.cuda.Event | None  # recorded after the copy; None when no copy was needed
    num_rows: int
    logprob_rows: np.ndarray  # [L]
    num_logprobs: np.ndarray  # [L]
    flagged: bool = False  # `host` ends with the [R] masked-row flags
    masked_rows: list[int] = field(default_factory=list)  # the rows they flag, once `wait` returned

    def wait(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The token of each row and, for the rows that asked, its logprobs."""
        if self.ready is not None:
            self.ready.synchronize()
        values, self.masked_rows[:] = unpack_flags(self.host, self.num_rows, self.flagged)
        num_rows, num_wanted = self.num_rows, len(self.logprob_rows)
        out: list[TokenLogprobs | None] = [None] * num_rows
        if not num_wanted:
            return values.tolist(), out
        tokens = values[:num_rows].astype(np.int64).tolist()
        chosen = values[num_rows : num_rows + num_wanted].tolist()
        k = max(int(self.num_logprobs.max()), 0)
        top = values[num_rows + num_wanted :]
        top_ids = top[: num_wanted * k].reshape(num_wanted, k).astype(np.int64).tolist()
        top_logprobs = top[num_wanted * k :].reshape(num_wanted, k).tolist()
        for j, (row, n) in enumerate(
            zip(self.logprob_rows.tolist(), self.num_logprobs.tolist(), strict=True)
        ):
            out[row] = TokenLogprobs(chosen[j], top_ids[j][:n], top_logprobs[j][:n])
        return tokens, out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row of `logits` ([R, V]) and, where asked, its logprobs."""
    return sample_tensors(logits, SamplingTensors.from_rows(rows, logits.device)).start_copy().wait()


def sample_tensors(logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
    """Draws every row of `logits` ([R, V], any float dtype) on its device without waiting for it: an argmax
    for the greedy rows, then each draw group on its own rows, written over the argmax."""
    logits = apply_token_bitmask(logits, tensors.token_bitmask)  # first: what follows sees allowed tokens
    num_rows = tensors.num_rows
    raw = logits  # logprobs are the raw distribution's
    if tensors.processors is not None:
        logits = apply_processors(logits, tensors.processors)
    masked = masked_rows(logits, tensors.token_bitmask is not None or tensors.processors is not None)
    if tensors.any_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    for group in tensors.groups:
        slots = slice(group.start, group.end)
        whole = group.end - group.start == num_rows  # then the slots are the rows in order
        rows = tensors.order[slots]
        if group.kind == "sorted" and tensors.round_uniforms is not None:  # no sort, worker/nucleus_draw.py
            tokens = draw_nucleus_into(tokens, logits, rows, tensors, slots, whole)
            continue
        scaled = _scaled_rows(logits, rows, tensors.temperature[slots], whole)
        top_k, top_p, uniforms = tensors.top_k[slots], tensors.top_p[slots], tensors.uniforms[slots]
        if group.kind == "plain":
            drawn = _inverse_cdf(scaled.softmax(dim=-1), uniforms)
        elif group.kind == "top_k":
            drawn = _draw_top_k(scaled, group.width, top_k, top_p, uniforms)
        else:
            values, ids = scaled.sort(dim=-1, descending=True, stable=True)
            drawn = ids.gather(1, _draw_sorted(values, top_k, top_p, uniforms)[:, None])[:, 0]
        del scaled  # before the next group's
        if whole:
            tokens = drawn
        else:
            tokens.index_copy_(0, rows, drawn)
    if tensors.processors is not None:
        record_sampled(tokens, tensors.processors)

    chosen = top_ids = top_logprobs = None
    if len(tensors.logprob_rows_host):
        chosen, top_ids, top_logprobs = _logprobs(raw, tokens, tensors)
    return SamplerOutput(
        tokens, chosen, top_ids, top_logprobs, tensors.logprob_rows_host, tensors.num_logprobs, masked
    )


def _scaled_rows(
    logits: torch.Tensor,  # [R, V]
    rows: torch.Tensor,  # [n] int64
    temperature: torch.Tensor,  # [n] float32
    whole: bool,  # rows is every row in order
) -> torch.Tensor:  # [n, V] float32, a new tensor the caller may overwrite
    if whole:
        return logits / temperature[:, None]
    picked = logits.index_select(0, rows)
    if picked.dtype == torch.float32:
        return picked.div_(temperature[:, None])
    return picked / temperature[:, None]


def _flip_negatives(bits: torch.Tensor) -> torch.Tensor:  # int32, in place
    """float32 bit patterns <-> int32s in the floats' order (an involution): flips the magnitude bits of the
    negative ones."""
    return bits.bitwise_xor_((bits >> 31) & 0x7FFFFFFF)


def _draw_top_k(
    scaled: torch.Tensor,  # [n, V] float32, consumed
    width: int,
    top_k: torch.Tensor,  # [n] int64, 1 <= top_k <= width
    top_p: torch.Tensor,  # [n] float32
    uniforms: torch.Tensor,  # [n] float64
) -> torch.Tensor:  # [n] token ids
    """The draw of `_draw_sorted` over the full descending sort, from its first `width` entries only. A stable
    sort puts equal logits in vocabulary order, so the candidates are picked by an int64 key that holds the
    logit's order in its high half and the reversed token id in its low half: all keys differ, and the
    `width` largest are exactly the stable sort's first `width` entries, in its order."""
    vocab = scaled.shape[-1]
    width = min(width, vocab)
    bits = _flip_negatives(scaled.add_(0.0).view(torch.int32))  # + 0.0 makes -0.0 equal to 0.0, as in a sort
    keys = bits.to(torch.int64).bitwise_left_shift_(32)
    keys.bitwise_or_(0xFFFFFFFF - torch.arange(vocab, device=keys.device))
    best = keys.topk(width, dim=-1).values  # [n, width] descending
    del keys
    ids = 0xFFFFFFFF - (best & 0xFFFFFFFF)
    values = _flip_negatives((best >> 32).to(torch.int32)).view(torch.float32)
    return ids.gather(1, _draw_sorted(values, top_k, top_p, uniforms)[:, None])[:, 0]


def _draw_sorted(
    values: torch.Tensor,  # [n, W] float32 scaled logits in descending order, consumed
    top_k: torch.Tensor,  # [n] int64, <= 0: off
    top_p: torch.Tensor,  # [n] float32, 1.0: off
    uniforms: torch.Tensor,  # [n] float64
) -> torch.Tensor:  # [n] column drawn
    """Softmax over the first top_k columns, cut to the smallest prefix holding top_p of that mass (the first
    column always stays), then inverse-CDF sampling in this descending order."""
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]  # [1, W]
    values.masked_fill_((rank >= top_k[:, None]) & (top_k[:, None] > 0), float("-inf"))
    probs = values.softmax(dim=-1)
    # A column is dropped when the columns before it already hold top_p.
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    return _inverse_cdf(probs, uniforms)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [n, W], [n] -> [n]
    """Index of the first entry whose cumulative mass exceeds u * total: entry i is drawn with probability
    probs[i] / total, and a zero-probability entry never."""
    cdf = probs.double().cumsum_(dim=-1)  # [n, W]; float64 so that a long vocabulary adds up accurately
    target = uniforms[:, None] * cdf[:, -1:]  # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u * total can round up to total itself; fall back to the last entry with mass in that case.
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).view(torch.uint8).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def _logprobs(
    logits: torch.Tensor,  # [R, V] raw
    tokens: torch.Tensor,  # [R] int64
    tensors: SamplingTensors,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # [L], [L, K] ids, [L, K] values
    """Logprobs under the raw distribution: before the logits processors, temperature, top-k and top-p."""
    rows = tensors.logprob_rows
    if len(rows) == tensors.num_rows:  # then the rows in order
        picked, chosen_tokens = logits, tokens
    else:
        picked, chosen_tokens = logits.index_select(0, rows), tokens.index_select(0, rows)
    logprobs = torch.log_softmax(picked, dim=-1, dtype=torch.float32)  # [L, V]
    # A NaN logit (a broken model) would make the scheduler refuse the whole step's output: report it as a
    # token of probability 0 instead, so that only that sequence's output is odd.
    logprobs.nan_to_num_(nan=float("-inf"))
    chosen = logprobs.gather(1, chosen_tokens[:, None])[:, 0]
    k = tensors.max_num_logprobs
    if k <= 0:
        return chosen, None, None
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return chosen, top_ids, top_logprobs
