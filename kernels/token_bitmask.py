"""Structured output's token bitmasks applied to the logits: one Triton launch over the constrained rows.

A constrained row's bitmask (bit t % 32 of word t // 32 allows token t, as xgrammar fills it) is ANDed with
one row of a small table of extra words (worker/structured.py: the JSON-safe tokens, or all ones) and every
token it does not allow gets -inf, in place, at the row's logits row: the rows without a constraint are not
read or written, and nothing is gathered or copied back. `apply_token_bitmask_reference` is the same in
PyTorch ops (kernels/reference_bitmask.py: the CPU path and the tests' reference). A bitmask narrower than
the logits (as wide as the tokenizer's vocabulary) bans every token past its words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 4096  # tokens per program: 128 words of the bitmask


# The per-row columns arrive as views into one packed transfer, at offsets that change from step to
# step: specialized on their 16-byte alignment, each new combination compiled again inside a step
# (worker/warmup.py compiles the one variant at start). The same for the masks' width: the tokenizer's
# (worker/structured.py), which the warm-up, without a tokenizer, does not know.
@triton.jit(
    do_not_specialize=["num_words"],
    do_not_specialize_on_alignment=[
        "bitmask_ptr",
        "rows_ptr",
        "kinds_ptr",
    ],
)
def _apply_token_bitmask_kernel(
    logits_ptr,  # [R, stride_logits] float (any dtype): rows of the step's logits
    bitmask_ptr,  # [n, num_words] int32, contiguous
    rows_ptr,  # [n] int64: each bitmask row's logits row
    kinds_ptr,  # [n] int32: each bitmask row's row of `extra`
    extra_ptr,  # [K, num_words] int32, contiguous: words ANDed into the bitmask
    vocab_size,
    num_words,
    stride_logits,
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
):
    r = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    kind = tl.load(kinds_ptr + r).to(tl.int64)
    word = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    in_words = word < num_words
    words = tl.load(bitmask_ptr + r.to(tl.int64) * num_words + word, mask=in_words, other=0)
    words &= tl.load(extra_ptr + kind * num_words + word, mask=in_words, other=0)
    banned = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0  # [BLOCK // 32, 32]
    banned = tl.reshape(banned, (BLOCK,))  # token word * 32 + bit, in order
    token = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * stride_logits + token, float("-inf"), mask=banned & (token < vocab_size))


def apply_token_bitmask(
    logits: torch.Tensor,  # [R, V] any float dtype, rows contiguous; written in place
    bitmask: torch.Tensor,  # [n, W] int32: the tokens past its W * 32 are banned (W < ceil(V / 32) allowed)
    rows: torch.Tensor,  # [n] int64: distinct logits rows
    kinds: torch.Tensor,  # [n] int32 or int64: rows of `extra`
    extra: torch.Tensor,  # [K, W] int32
) -> torch.Tensor:
    """`logits` with every token that row r's `bitmask[r] & extra[kinds[r]]` does not allow at -inf, at
    logits row `rows[r]`; one launch, no host sync."""
    n, vocab = len(rows), logits.shape[-1]
    if n == 0:
        return logits
    assert logits.stride(-1) == 1 and bitmask.dtype == torch.int32 and extra.dtype == torch.int32
    bitmask, extra = bitmask.contiguous(), extra.contiguous()
    assert bitmask.shape[1] == extra.shape[1]
    grid = (n, triton.cdiv(vocab, BLOCK_TOKENS))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows, kinds, extra, vocab, bitmask.shape[1], logits.stride(0), BLOCK=BLOCK_TOKENS
    )
    return logits
