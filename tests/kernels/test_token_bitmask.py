"""kernels/token_bitmask.py: the one-launch bitmask application against its PyTorch reference, and the
reference against a per-token loop over the bits."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.reference_bitmask import apply_token_bitmask_reference
from pagedserve.kernels.token_bitmask import apply_token_bitmask
from tests.kernels.conftest import gpu


def _case(vocab: int, num_words: int, num_rows: int, n: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab + 8, generator=gen).to(dtype)[:, :vocab]  # rows strided past V
    bitmask = torch.randint(-(2**31), 2**31, (n, num_words), generator=gen, dtype=torch.int64).int()
    bitmask[:1] = 0  # a row that allows nothing
    extra = torch.randint(-(2**31), 2**31, (3, num_words), generator=gen, dtype=torch.int64).int()
    extra[0] = -1
    rows = torch.randperm(num_rows, generator=gen)[:n]
    kinds = torch.randint(0, 3, (n,), generator=gen, dtype=torch.int32)
    return [t.to(device) for t in (logits, bitmask, rows, kinds, extra)]


@pytest.mark.parametrize("num_words", [4, 2], ids=["full", "narrower-than-the-logits"])
def test_reference_masks_exactly_the_tokens_without_their_bit(num_words):
    logits, bitmask, rows, kinds, extra = _case(100, num_words, 6, 4, torch.float32, "cpu")
    out = apply_token_bitmask_reference(logits.clone(), bitmask, rows, kinds, extra)
    expected = logits.clone()
    for r in range(len(rows)):
        for t in range(100):
            if t // 32 >= num_words:  # past the mask's words: banned
                expected[rows[r], t] = float("-inf")
                continue
            word = int(bitmask[r, t // 32]) & int(extra[kinds[r], t // 32])
            if not (word >> (t % 32)) & 1:
                expected[rows[r], t] = float("-inf")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("vocab", "num_words", "num_rows", "n"),
    [(100, 4, 6, 4), (4200, 132, 5, 5), (4100, 129, 9, 3), (32, 1, 2, 2), (70, 3, 3, 0), (9000, 128, 4, 3)],
    ids=["small", "two-blocks-padded-words", "partial", "one-word", "no-rows", "narrower-than-the-logits"],
)
def test_kernel_matches_reference(device, dtype, vocab, num_words, num_rows, n):
    logits, bitmask, rows, kinds, extra = _case(vocab, num_words, num_rows, n, dtype, device)
    expected = apply_token_bitmask_reference(logits.clone(), bitmask, rows, kinds, extra)
    out = logits.clone()
    assert apply_token_bitmask(out, bitmask, rows, kinds, extra) is out
    assert torch.equal(out, expected)


@gpu
def test_kernel_matches_reference_at_llama_vocabulary():
    logits, bitmask, rows, kinds, extra = _case(128256, 4008, 512, 300, torch.bfloat16, "cuda")
    expected = apply_token_bitmask_reference(logits.clone(), bitmask, rows, kinds, extra)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask, rows, kinds, extra), expected)
    # a mask as wide as a 4,096-token tokenizer over the same logits: every token past it banned
    logits, bitmask, rows, kinds, extra = _case(128256, 128, 512, 300, torch.bfloat16, "cuda")
    expected = apply_token_bitmask_reference(logits.clone(), bitmask, rows, kinds, extra)
    out = apply_token_bitmask(logits.clone(), bitmask, rows, kinds, extra)
    assert torch.equal(out, expected) and bool((out[rows][:, 4096:] == float("-inf")).all())
