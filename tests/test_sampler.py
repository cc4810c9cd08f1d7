"""The sampler: greedy, top-k / top-p support, seeded reproducibility, logprobs, drawn distribution."""

from __future__ import annotations

import random

import pytest
import torch

from worker.sampler import SamplingRow, sample

VOCAB = 257


def _row(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    position: int = 0,
    num_logprobs: int = -1,
) -> SamplingRow:
    return SamplingRow(temperature, top_k, top_p, seed, position, num_logprobs)


def _logits(rows: int, seed: int, vocab: int = VOCAB, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread


def test_greedy_is_argmax() -> None:
    logits = _logits(9, seed=1)
    tokens, _ = sample(logits, [_row(temperature=0.0, seed=s, position=3) for s in range(9)])
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = _logits(16, seed=2)
    rows = [_row(temperature, top_k=1, seed=s, position=s * 7) for s in range(16)]
    tokens, _ = sample(logits, rows)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_draws_stay_in_the_k_most_likely_tokens() -> None:
    logits = _logits(1, seed=3, spread=0.5).expand(400, -1)  # flat-ish: every allowed token gets drawn
    top5 = set(logits[0].topk(5).indices.tolist())
    rows = [_row(temperature=2.0, top_k=5, seed=11, position=p) for p in range(400)]
    tokens, _ = sample(logits, rows)
    assert set(tokens) == top5


def test_top_p_draws_stay_in_the_nucleus() -> None:
    # Known distribution on shuffled ids: masses 0.5, 0.3, 0.15, then 0.05 spread over the rest.
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))
    probs = torch.full((VOCAB,), 0.05 / (VOCAB - 3))
    probs[order[:3]] = torch.tensor([0.5, 0.3, 0.15])
    logits = probs.log()[None].expand(600, -1)
    # 0.7: the first token holds 0.5 < 0.7, the first two 0.8 >= 0.7, so exactly two tokens stay.
    tokens, _ = sample(logits, [_row(top_p=0.7, seed=5, position=p) for p in range(300)] * 2)
    assert set(tokens) == set(order[:2].tolist())
    # Combined with top_k=1 only the best remains; with top_p=0.9 the third joins.
    tokens, _ = sample(logits[:300], [_row(top_p=0.9, top_k=1, seed=6, position=p) for p in range(300)])
    assert set(tokens) == {order[0].item()}
    tokens, _ = sample(logits[:300], [_row(top_p=0.9, seed=6, position=p) for p in range(300)])
    assert set(tokens) == set(order[:3].tolist())


def test_draw_depends_only_on_seed_and_position_not_on_the_batch() -> None:
    rng = random.Random(8)
    logits = _logits(24, seed=8, spread=1.0)
    rows = [
        _row(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 0, 3, 40]),
            top_p=rng.choice([1.0, 1.0, 0.8, 0.95]),
            seed=rng.randrange(2**63),
            position=rng.randrange(5000),
        )
        for _ in range(24)
    ]
    together, _ = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(24)]
    perm = list(range(24))
    rng.shuffle(perm)
    shuffled, _ = sample(logits[perm], [rows[i] for i in perm])
    subset = perm[:7]
    partial, _ = sample(logits[subset], [rows[i] for i in subset])
    assert together == alone
    assert shuffled == [together[i] for i in perm]
    assert partial == [together[i] for i in subset]


def test_different_seeds_and_positions_draw_differently() -> None:
    logits = torch.zeros(300, VOCAB)  # uniform: each draw is one of VOCAB tokens
    by_seed, _ = sample(logits, [_row(seed=s, position=10) for s in range(300)])
    by_position, _ = sample(logits, [_row(seed=42, position=p) for p in range(300)])
    # 300 uniform draws from 257 tokens hit about 176 distinct ones; a broken mix would hit a handful.
    assert len(set(by_seed)) > 120
    assert len(set(by_position)) > 120
    assert by_seed != by_position


def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    logits = _logits(4, seed=9)
    rows = [
        _row(temperature=0.5, top_k=10, seed=1, num_logprobs=5),
        _row(temperature=0.0, num_logprobs=0),
        _row(temperature=1.3, top_p=0.5, seed=2, num_logprobs=-1),
        _row(temperature=2.0, seed=3, num_logprobs=20),
    ]
    tokens, logprobs = sample(logits, rows)
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[2] is None
    for i in (0, 1, 3):
        lp = logprobs[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(expected[i, tokens[i]].item(), abs=1e-5)
        k = rows[i].num_logprobs
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_token_ids == expected[i].topk(k).indices.tolist()
        for tok, val in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            assert val == pytest.approx(expected[i, tok].item(), abs=1e-5)


def _chi_square(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs.tolist(), strict=True))


@pytest.mark.parametrize("top_k", [0, 3])
def test_seeded_draws_follow_the_softmax(top_k: int) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 1.5])
    draws = 20000
    rows = [_row(top_k=top_k, seed=1234 + p % 7, position=p) for p in range(draws)]
    tokens, _ = sample(logits[None].expand(draws, -1), rows)
    probs = torch.softmax(logits.double(), dim=-1)
    if top_k:
        keep = logits.topk(top_k).indices
        probs = torch.softmax(logits.double()[keep], dim=-1)
        assert set(tokens) == set(keep.tolist())
        counts = [tokens.count(t) for t in keep.tolist()]
    else:
        counts = [tokens.count(t) for t in range(len(logits))]
    # Degrees of freedom are at most 7; chi-square 30 has p < 1e-4 there, while a sampler that drew from the
    # wrong distribution by a few percent would land in the hundreds at 20000 draws.
    assert _chi_square(counts, probs) < 30.0
