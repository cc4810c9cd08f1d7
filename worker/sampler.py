"""Picks the next token of each sampling sequence from its logits row, and reports logprobs.

Reproducibility: a sequence's draw depends only on its logits, its own parameters, its seed and the index of
the token being sampled, never on its batch-mates or its history. Each row draws by inverse-CDF sampling with
one uniform number hashed from (seed, position), and the order in which it accumulates probability is fixed
by its own parameters alone. A sequence preempted and recomputed, or batched differently, draws the same
token (up to the float noise of the logits themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.messages import TokenLogprobs

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position), well mixed in both."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) / float(1 << 53)


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one sampling sequence."""

    temperature: float  # 0: greedy
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    seed: int
    position: int  # index of the token being sampled within its sequence
    num_logprobs: int  # -1: none; k >= 0: sampled token's logprob and the top k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _filtered_sorted_probs(
    logits: torch.Tensor,  # [R, V] float32, already divided by temperature
    top_k: torch.Tensor,  # [R] int64, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1.0 = off
) -> tuple[torch.Tensor, torch.Tensor]:  # probs [R, V] in descending order, their token ids [R, V]
    """Softmax over the top-k tokens, then cut to the smallest prefix holding top_p of the mass."""
    # Stable, so equal logits keep vocabulary order and top_k=1 agrees with argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens before it already hold top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return probs, sorted_ids


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [R, V], [R] -> [R]
    """Index of the first entry whose cumulative mass exceeds u * total: entry i is drawn with probability
    probs[i] / total, and a zero-probability entry never."""
    cdf = probs.double().cumsum(dim=-1)  # [R, V]; float64 so that a long vocabulary adds up accurately
    target = uniforms.double()[:, None] * cdf[:, -1:]  # [R, 1]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u * total can round up to total itself; fall back to the last entry with mass in that case.
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row of `logits` ([R, V]) and, where asked, its logprobs."""
    device = logits.device
    logits = logits.float()
    num_rows = len(rows)
    tokens = torch.empty(num_rows, dtype=torch.long, device=device)

    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=device)
        tokens[idx] = logits[idx].argmax(dim=-1)

    # Rows with top-k/top-p accumulate mass in descending order, the others in vocabulary order (no sort);
    # which way a row goes depends only on its own parameters, which keeps its draw batch-independent.
    for want_filter in (False, True):
        group = [i for i, r in enumerate(rows) if not r.greedy and r.filtered == want_filter]
        if not group:
            continue
        idx = torch.tensor(group, device=device)
        temps = torch.tensor([rows[i].temperature for i in group], device=device)
        uniforms = torch.tensor(
            [uniform_for(rows[i].seed, rows[i].position) for i in group], dtype=torch.float64, device=device
        )
        scaled = logits[idx] / temps[:, None]
        if want_filter:
            top_k = torch.tensor([rows[i].top_k for i in group], device=device)
            top_p = torch.tensor([rows[i].top_p for i in group], device=device, dtype=torch.float32)
            probs, ids = _filtered_sorted_probs(scaled, top_k, top_p)
            tokens[idx] = ids.gather(1, _inverse_cdf(probs, uniforms)[:, None])[:, 0]
        else:
            tokens[idx] = _inverse_cdf(scaled.softmax(dim=-1), uniforms)

    token_list = tokens.tolist()
    return token_list, _logprobs(logits, tokens, rows)


def _logprobs(
    logits: torch.Tensor,  # [R, V] float32, raw
    tokens: torch.Tensor,  # [R]
    rows: list[SamplingRow],
) -> list[TokenLogprobs | None]:
    """Logprobs under the raw distribution: before temperature, top-k and top-p."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.num_logprobs >= 0]
    if not wanted:
        return out
    idx = torch.tensor(wanted, device=logits.device)
    logprobs = logits[idx].log_softmax(dim=-1)  # [W, V]
    chosen = logprobs.gather(1, tokens[idx][:, None])[:, 0].tolist()
    k = max(rows[i].num_logprobs for i in wanted)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], idx[:, None][:, :0])
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].num_logprobs
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_vals[j][:n])
    return out
