"""The logits processors' Triton kernels (kernels/processors.py, interpreted on the CPU) against their PyTorch
reference and against the per-row float64 formula of tests/test_logits_processors.py, over fresh random
batches of uneven prompt and output lengths and several tiles of vocabulary."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.kernels import processors, reference_processors
from pagedserve.worker.logits_processors import LogitsProcessors
from tests.test_logits_processors import Seq, assert_rows_match, reference

VOCAB = 300


def _batch(seed: int) -> tuple[list[Seq], torch.Tensor]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(12):
        kind = rng.randrange(4)
        kw: dict = dict(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), max_tokens=64)
        if kind in (0, 2):
            kw |= dict(
                presence_penalty=rng.uniform(-2, 2),
                frequency_penalty=rng.uniform(-2, 2),
                repetition_penalty=rng.uniform(0.2, 2),
            )
        if kind in (1, 2):
            kw["min_p"] = rng.uniform(0.01, 0.5)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 200))]
        output = [rng.randrange(rng.choice([8, VOCAB])) for _ in range(rng.randrange(0, 150))]
        seqs.append(Seq(SamplingParams(**kw), prompt + output, len(prompt)))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[0, :7] = float("-inf")  # banned earlier in the chain
    return seqs, logits


@pytest.mark.parametrize(("seed", "block"), [(0, 64), (1, 128), (2, 2048)])
def test_kernels_match_the_reference_and_the_formula(seed: int, block: int) -> None:
    seqs, logits = _batch(seed)
    processors_ = LogitsProcessors(VOCAB, (2,), "cpu")
    position = np.array([len(s.token_ids) for s in seqs])
    pt = processors_.prepare(seqs, position)
    assert pt is not None and pt.history is not None and len(pt.penalty_rows) and len(pt.min_p_rows)
    history = pt.history
    penalty_args = (pt.penalty_rows, pt.penalty_slots, history.counts, history.in_prompt)
    penalty_values = (pt.presence, pt.frequency, pt.repetition)

    got = logits.clone()
    processors.penalize_(got, *penalty_args, *penalty_values, block=block)
    want = logits.clone()
    reference_processors.penalize_(want, *penalty_args, *penalty_values)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    processors.min_p_(got, pt.min_p_rows, pt.min_p_shift, block=block)
    reference_processors.min_p_(want, pt.min_p_rows, pt.min_p_shift)
    assert torch.equal(got.isinf(), want.isinf())
    for j, seq in enumerate(seqs):
        assert_rows_match(got[j], reference(logits[j], seq))


def test_rows_not_named_are_left_alone() -> None:
    seqs, logits = _batch(3)
    pt = LogitsProcessors(VOCAB, (2,), "cpu").prepare(seqs, np.array([len(s.token_ids) for s in seqs]))
    assert pt is not None and pt.history is not None
    got = logits.clone()
    processors.penalize_(
        got, pt.penalty_rows, pt.penalty_slots, pt.history.counts, pt.history.in_prompt,
        pt.presence, pt.frequency, pt.repetition, block=64,
    )  # fmt: skip
    processors.min_p_(got, pt.min_p_rows, pt.min_p_shift, block=64)
    named = set(pt.penalty_rows.tolist()) | set(pt.min_p_rows.tolist())
    for j in range(len(seqs)):
        if j not in named:
            assert torch.equal(got[j], logits[j])
