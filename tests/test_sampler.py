"""The sampler: greedy, top-k / top-p support, seeded reproducibility, logprobs, drawn distribution, and the
batched device path against a plain per-row reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedserve.common.messages import SamplingParams, TokenLogprobs
from pagedserve.worker.sampler import (
    SamplingRow,
    SamplingTensors,
    sample,
    sample_tensors,
    uniform_for,
    uniforms_for,
)

VOCAB = 257


def _row(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    position: int = 0,
    num_logprobs: int = -1,
) -> SamplingRow:
    logprobs = None if num_logprobs < 0 else num_logprobs
    return SamplingRow(
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs), seed, position
    )


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


# The batched path against a per-row reference written from the documented semantics.


def _reference_draw(logits_row: torch.Tensor, row: SamplingRow) -> int:
    """One row drawn alone, step by step: argmax when greedy; otherwise the logits divided by the temperature,
    sorted descending with equal logits in vocabulary order when filtered (softmax over the first top_k,
    then a token dropped when the tokens before it already hold top_p) or left in vocabulary order when not,
    and the first token whose float64 cumulative mass exceeds u * total, u = uniform_for(seed, position)."""
    x = logits_row.float()
    if row.greedy:
        return int(x.argmax())
    scaled = x / torch.tensor(row.temperature, dtype=torch.float32)
    if row.filtered:
        values, ids = scaled.sort(descending=True, stable=True)
        if row.top_k > 0:
            values, ids = values[: row.top_k], ids[: row.top_k]
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= torch.tensor(row.top_p, dtype=torch.float32), 0.0)
    else:
        probs, ids = scaled.softmax(dim=-1), torch.arange(len(x))
    cdf = probs.double().cumsum(dim=-1).tolist()
    target = uniform_for(row.seed, row.position) * cdf[-1]
    for i, mass in enumerate(cdf):
        if mass > target:
            return int(ids[i])
    return int(ids[max(i for i, p in enumerate(probs.tolist()) if p > 0)])


def _random_rows(rng: random.Random, count: int, top_ks: list[int]) -> list[SamplingRow]:
    return [
        _row(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 0, *top_ks]),
            top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
            seed=rng.randrange(-(2**63), 2**64),
            position=rng.randrange(10**6),
            num_logprobs=rng.choice([-1, -1, 0, 1, 5]),
        )
        for _ in range(count)
    ]


def _assert_logprobs(
    logits: torch.Tensor, tokens: list[int], logprobs: list[TokenLogprobs | None], rows: list[SamplingRow]
) -> None:
    for i, row in enumerate(rows):
        lp = logprobs[i]
        if row.num_logprobs < 0:
            assert lp is None
            continue
        assert lp is not None
        expected = logits[i].float().log_softmax(dim=-1)
        assert lp.logprob == expected[tokens[i]].item()
        assert lp.top_token_ids == expected.topk(row.num_logprobs).indices.tolist()
        assert lp.top_logprobs == expected.topk(row.num_logprobs).values.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_batched_draws_match_the_per_row_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    logits = _logits(200, seed=100 + seed, spread=rng.choice([0.5, 2.0, 5.0]))
    rows = _random_rows(rng, 200, top_ks=[1, 2, 5, 40, 64, 65, 100, 256, 257, 1000])
    tokens, logprobs = sample(logits, rows)
    assert tokens == [_reference_draw(logits[i], row) for i, row in enumerate(rows)]
    _assert_logprobs(logits, tokens, logprobs, rows)


def test_equal_logits_are_taken_in_vocabulary_order() -> None:
    # Logits on a coarse grid (as bfloat16 logits are) tie often, also across the top-k cut.
    rng = random.Random(11)
    logits = (_logits(300, seed=11, spread=1.5) * 2).round() / 2
    rows = _random_rows(rng, 300, top_ks=[1, 2, 3, 7, 20, 50, 64, 70])
    tokens, _ = sample(logits, rows)
    assert tokens == [_reference_draw(logits[i], row) for i, row in enumerate(rows)]


def test_negative_zero_ties_with_zero() -> None:
    logits = torch.full((2, VOCAB), -5.0)
    logits[0, 3], logits[0, 9] = -0.0, 0.0
    logits[1, 3], logits[1, 9] = 0.0, -0.0
    for temperature in (0.0, 1.0):
        tokens, _ = sample(logits, [_row(temperature, top_k=1)] * 2)
        assert tokens == [3, 3]


def test_large_top_k_takes_the_full_sort_with_the_same_draws() -> None:
    vocab = 6000
    logits = _logits(40, seed=12, vocab=vocab, spread=0.3)
    rows = [
        _row(temperature=1.0, top_k=k, top_p=p, seed=s, position=7)
        for s, (k, p) in enumerate([(4096, 1.0), (4097, 1.0), (5999, 0.99), (10**9, 1.0), (3000, 0.95)] * 8)
    ]
    kinds = {(g.kind, g.width) for g in SamplingTensors.from_rows(rows, "cpu").groups}
    assert kinds == {("top_k", 4096), ("sorted", 0)}
    tokens, _ = sample(logits, rows)
    assert tokens == [_reference_draw(logits[i], row) for i, row in enumerate(rows)]


def test_a_row_draws_the_same_alone_and_in_any_batch() -> None:
    rng = random.Random(13)
    logits = _logits(120, seed=13, spread=2.0)
    rows = _random_rows(rng, 120, top_ks=[1, 3, 40, 100, 300, 5000])
    alone = [sample(logits[i : i + 1], [rows[i]]) for i in range(len(rows))]
    for _ in range(4):
        batch = rng.sample(range(len(rows)), rng.randrange(2, len(rows)))
        tokens, logprobs = sample(logits[batch], [rows[i] for i in batch])
        assert tokens == [alone[i][0][0] for i in batch]
        assert logprobs == [alone[i][1][0] for i in batch]


def _bits64(value: int) -> int:
    """The signed int64 holding the low 64 bits of value."""
    return ((value & (2**64 - 1)) ^ 2**63) - 2**63


def test_device_uniforms_equal_uniform_for_bit_for_bit() -> None:
    rng = random.Random(14)
    seeds = [0, 1, 2, -1, -2, 2**31, 2**32 - 1, 2**63 - 2, 2**63 - 1, 2**63, 2**63 + 1, -(2**63)]
    seeds += [2**64 - 2, 2**64 - 1, *(rng.randrange(-(2**63), 2**64) for _ in range(40))]
    positions = [
        0,
        1,
        2,
        31,
        2**31 - 1,
        2**32,
        2**53 + 1,
        2**63 - 1,
        *(rng.randrange(10**6) for _ in range(12)),
    ]
    pairs = [(s, p) for s in seeds for p in positions]
    got = uniforms_for(np.array([_bits64(s) for s, _ in pairs]), np.array([p for _, p in pairs]))
    assert got.dtype == np.float64
    unsigned = np.array([s & (2**64 - 1) for s, _ in pairs], dtype=np.uint64)  # the same bits as uint64
    assert uniforms_for(unsigned, np.array([p for _, p in pairs])).tolist() == got.tolist()
    assert got.tolist() == [uniform_for(s, p) for s, p in pairs]
    # And as the sampler builds them, by slot.
    rows = [_row(seed=s, position=p) for s, p in pairs]
    tensors = SamplingTensors.from_rows(rows, "cpu")
    slots = tensors.order.tolist()
    assert tensors.uniforms.tolist() == [uniform_for(*pairs[r]) for r in slots]


def test_all_greedy_batch_is_an_argmax_alone() -> None:
    logits = _logits(9, seed=15)
    rows = [_row(temperature=0.0, top_k=5, top_p=0.5, seed=s) for s in range(9)]
    tensors = SamplingTensors.from_rows(rows, "cpu")
    assert tensors.groups == () and tensors.any_greedy and tensors.max_num_logprobs == -1
    out = sample_tensors(logits, tensors)
    assert out.chosen_logprobs is None
    assert out.start_copy().wait() == (logits.argmax(dim=-1).tolist(), [None] * 9)


def test_arrays_and_bfloat16_logits_give_the_same_draws() -> None:
    rng = random.Random(16)
    logits = _logits(64, seed=16).bfloat16()
    rows = _random_rows(rng, 64, top_ks=[1, 5, 40, 200])
    expected = sample(logits.float(), rows)
    assert sample(logits, rows) == expected
    tensors = SamplingTensors.from_arrays(
        temperature=np.array([r.temperature for r in rows]),
        top_k=np.array([r.top_k for r in rows]),
        top_p=np.array([r.top_p for r in rows]),
        seed=np.array([_bits64(r.seed) for r in rows], dtype=np.int64),
        position=np.array([r.position for r in rows]),
        num_logprobs=np.array([r.num_logprobs for r in rows]),
        device="cpu",
    )
    assert sample_tensors(logits.float(), tensors).start_copy().wait() == expected
