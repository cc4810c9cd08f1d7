"""Speculative decoding's parts: the config, the n-gram proposer against a brute-force search, and the
verifier's output distribution against the exact softmax (chi-square over many seeded samples, tiny vocab)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.common.speculative import parse_speculative_config
from pagedserve.worker.logits_processors import LogitsProcessors
from pagedserve.worker.sampler import sample_tensors
from pagedserve.worker.sequences import SeqState
from pagedserve.worker.spec.ngram import NgramProposer
from pagedserve.worker.spec.proposer import ProposeRow
from pagedserve.worker.spec.verify import SpecBatch

# ---------------------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize(
    "text,named",
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mx": 3}', "prompt_lookup_mx"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "model"),
        (
            '{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_min",
        ),
        ("[1, 2]", "object"),
        ("{nope", "JSON"),
    ],
)
def test_a_bad_speculative_config_fails_at_start_naming_the_key(tiny_model_dir, text, named):
    with pytest.raises(ValueError, match=named):
        WorkerConfig(model=str(tiny_model_dir), device="cpu", speculative_config=text)


def test_vllm_shape_is_accepted():
    spec = parse_speculative_config(json.dumps({"num_speculative_tokens": 3, "prompt_lookup_max": 5}))
    assert spec is not None and spec.method == "ngram" and spec.prompt_lookup_max == 5
    assert parse_speculative_config("") is None


# ---------------------------------------------------------------------------------------------------------
# the n-gram proposer


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, in plain Python: the longest suffix (hi down to lo) found earlier, its latest
    occurrence, the k tokens after it."""
    n_total = len(tokens)
    for n in range(min(hi, n_total - 1), lo - 1, -1):
        suffix = tokens[n_total - n :]
        for start in range(n_total - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    k=st.integers(1, 6),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_ngram_matches_brute_force(tokens, k, lo, extra):
    proposer = NgramProposer(lo, lo + extra)
    assert proposer.propose([ProposeRow(0, tokens, k)]) == [brute_force(tokens, k, lo, lo + extra)]


def test_ngram_examples():
    proposer = NgramProposer(1, 3)
    # "a b c d ... a b c" -> "d ..."
    rows = [ProposeRow(0, [1, 2, 3, 4, 5, 1, 2, 3], 2), ProposeRow(1, [7, 8, 9], 3), ProposeRow(2, [5], 2)]
    assert proposer.propose(rows) == [[4, 5], [], []]
    # the longest suffix wins over a more recent shorter one
    assert proposer.propose([ProposeRow(0, [1, 2, 9, 5, 2, 6, 2], 1)]) == [[6]]
    assert NgramProposer(2, 3).propose([ProposeRow(0, [4, 1, 2, 7, 5, 2, 1, 2], 2)]) == [[7, 5]]


def test_ngram_work_is_bounded_by_the_lookback():
    proposer = NgramProposer(1, 4, lookback=1000)
    tokens = list(range(5000)) + [10]  # 10 occurs at index 10, outside the last 1000 tokens
    assert proposer.propose([ProposeRow(0, tokens, 3)]) == [[]]
    assert NgramProposer(1, 4).propose([ProposeRow(0, tokens, 3)]) == [[11, 12, 13]]


# ---------------------------------------------------------------------------------------------------------
# the verifier's distribution

VOCAB = 6
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square quantiles at 0.999
NUM_SAMPLES = 6000


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed, prefix-dependent 'model' over a tiny vocabulary."""
    g = torch.Generator().manual_seed(hash(prefix) % (1 << 31))
    return torch.randn(VOCAB, generator=g, dtype=torch.float32) * 1.5


def exact_probs(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from, computed here by its definition (vLLM's order)."""
    z = logits.double() / p.temperature
    probs = torch.softmax(z, -1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    order = torch.argsort(z, descending=True, stable=True)
    if p.top_k:
        keep[order[p.top_k :]] = False
    masked = torch.where(keep, probs, torch.zeros_like(probs))
    masked = masked / masked.sum()
    if p.top_p < 1.0:
        before = torch.cumsum(masked[order], 0) - masked[order]
        drop = order[before >= p.top_p]
        masked[drop] = 0.0
        masked = masked / masked.sum()
    return masked.numpy()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[bool, float]:
    n = counts.sum()
    assert not counts[probs == 0].any(), "a token of probability 0 was drawn"
    support = probs > 0
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return (df == 0 or stat < CHI2_999[df]), stat


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.8, top_k=4),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.3, min_p=0.15),
    ],
    ids=["t1", "top_p_top_k", "top_k", "min_p"],
)
def test_speculative_sampling_follows_the_target_distribution(params):
    """Many sequences (one seed each) verify the same two drafts after the same prefix. The first emitted
    token must follow the target's distribution at the first position; given that the first draft was
    accepted, the second must follow it at the second position; the acceptance rate is p(draft)."""
    prompt = [1, 2, 3]
    p0 = exact_probs(target_logits(tuple(prompt)), params)
    d0 = int(np.argsort(p0)[-2])  # the second most likely: accepted about half the time or less
    p1 = exact_probs(target_logits((*prompt, d0)), params)
    d1 = int(np.argmax(p1))
    drafts = [d0, d1]
    rows = torch.stack([target_logits(tuple(prompt + drafts[:j])) for j in range(3)])
    seqs = [SeqState(list(prompt), len(prompt) - 1, params, seed, -1, i, processed=params.processed)
            for i, seed in enumerate(range(NUM_SAMPLES))]  # fmt: skip
    batch = SpecBatch([1 + len(drafts)] * NUM_SAMPLES, seqs, [drafts] * NUM_SAMPLES, [True] * NUM_SAMPLES, 4)
    processors = LogitsProcessors(VOCAB, (), "cpu")
    tensors = batch.sampling_tensors(seqs, torch.device("cpu"), processors)
    tokens, logprobs = sample_tensors(rows.repeat(NUM_SAMPLES, 1), tensors).start_copy().wait()
    firsts, emitted, _ = batch.accept(tokens, logprobs)

    first = np.bincount(firsts, minlength=VOCAB)
    ok, stat = chi_square_ok(first, p0)
    assert ok, (stat, first, p0)
    accepted = [run for run in emitted if run[0] == d0]
    assert all(len(run) >= 2 for run in accepted) and all(len(run) == 1 for run in emitted if run[0] != d0)
    rate = len(accepted) / NUM_SAMPLES
    assert abs(rate - p0[d0]) < 4 * math.sqrt(p0[d0] * (1 - p0[d0]) / NUM_SAMPLES) + 1e-9
    second = np.bincount([run[1] for run in accepted], minlength=VOCAB)
    ok, stat = chi_square_ok(second, p1)
    assert ok, (stat, second, p1)


def test_greedy_acceptance_is_the_argmax_run():
    params = SamplingParams(temperature=0.0)
    prompt = [4, 4]
    best = [int(target_logits(tuple(prompt)).argmax())]
    best.append(int(target_logits((*prompt, best[0])).argmax()))
    wrong = (best[1] + 1) % VOCAB
    for drafts, expected in [([best[0], best[1]], 3), ([best[0], wrong], 2), ([wrong, best[1]], 1)]:
        rows = torch.stack([target_logits(tuple(prompt + drafts[:j])) for j in range(3)])
        seq = SeqState(list(prompt), 1, params, 0, -1, 0)
        batch = SpecBatch([3], [seq], [drafts], [True], 4)
        tensors = batch.sampling_tensors([seq], torch.device("cpu"), None)
        tokens, logprobs = sample_tensors(rows, tensors).start_copy().wait()
        _, emitted, _ = batch.accept(tokens, logprobs)
        assert len(emitted[0]) == expected
        assert emitted[0] == [int(rows[j].argmax()) for j in range(expected)]


def test_ngram_keeps_each_sequence_as_it_grows():
    """Only appended tokens are converted; a new list under an id (a recompute) or `free` starts over."""
    rng = np.random.default_rng(0)
    proposer = NgramProposer(1, 3)
    tokens = rng.integers(0, 5, size=3).tolist()
    for _ in range(200):
        tokens.append(int(rng.integers(0, 5)))
        assert proposer.propose([ProposeRow(9, tokens, 3)]) == [brute_force(tokens, 3, 1, 3)]
    other = list(reversed(tokens))
    assert proposer.propose([ProposeRow(9, other, 3)]) == [brute_force(other, 3, 1, 3)]
    proposer.free(9)
    assert proposer.propose([ProposeRow(9, tokens[:7], 2)]) == [brute_force(tokens[:7], 2, 1, 3)]
