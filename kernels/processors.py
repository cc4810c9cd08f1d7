"""Triton kernels for the logits processors' per-vocabulary rules (worker/logits_processors.py), in place on
the rows they name: one program per row, a loop over the vocabulary in tiles. Where PyTorch runs about a
dozen passes over [rows, vocab] (gathers, masks, products, a scatter back) for the penalties and five for
min_p, each kernel reads what it needs once and writes only the tokens it changes. The reference is
kernels/reference_processors.py; the results equal it but for the compiler's fused multiply-adds (a last
bit of a penalized logit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


# The per-row columns arrive as views into one packed transfer, at offsets that change from step to
# step: specialized on their 16-byte alignment, each new combination compiled again inside a step
# (worker/warmup.py compiles the one variant at start).
@triton.jit(
    do_not_specialize_on_alignment=[
        "rows_ptr",
        "slots_ptr",
        "presence_ptr",
        "frequency_ptr",
        "repetition_ptr",
    ]
)
def _penalize_kernel(
    out_ptr,  # [R, V] float32
    stride_out,
    rows_ptr,  # [N] int64
    slots_ptr,  # [N] int64
    counts_ptr,  # [S, V] int32
    stride_counts,
    prompt_ptr,  # [S, V] uint8 (bool)
    stride_prompt,
    presence_ptr,  # [N] float32
    frequency_ptr,
    repetition_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    row_ptr = out_ptr + tl.load(rows_ptr + j) * stride_out
    slot = tl.load(slots_ptr + j)
    count_ptr = counts_ptr + slot * stride_counts
    in_prompt_ptr = prompt_ptr + slot * stride_prompt
    presence = tl.load(presence_ptr + j)
    frequency = tl.load(frequency_ptr + j)
    repetition = tl.load(repetition_ptr + j)
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        valid = ids < vocab
        count = tl.load(count_ptr + ids, mask=valid, other=0)
        generated = count > 0
        seen = valid & (generated | (tl.load(in_prompt_ptr + ids, mask=valid, other=0) != 0))
        # Only seen tokens change (an unseen one's factor is 1 and its count 0): read and write just those.
        x = tl.load(row_ptr + ids, mask=seen, other=0.0)
        x = tl.where(x > 0, x / repetition, x * repetition)
        x = x - frequency * count.to(tl.float32)
        x = x - presence * generated.to(tl.float32)
        tl.store(row_ptr + ids, x, mask=seen)


# The per-row columns arrive as views into one packed transfer, at offsets that change from step to
# step: specialized on their 16-byte alignment, each new combination compiled again inside a step
# (worker/warmup.py compiles the one variant at start).
@triton.jit(
    do_not_specialize_on_alignment=[
        "rows_ptr",
        "shift_ptr",
    ]
)
def _min_p_kernel(
    out_ptr,  # [R, V] float32
    stride_out,
    rows_ptr,  # [M] int64
    shift_ptr,  # [M] float32
    vocab,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    row_ptr = out_ptr + tl.load(rows_ptr + j) * stride_out
    offs = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        best = tl.maximum(best, tl.max(tl.load(row_ptr + ids, mask=ids < vocab, other=float("-inf")), axis=0))
    cut = best + tl.load(shift_ptr + j)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        x = tl.load(row_ptr + ids, mask=ids < vocab, other=0.0)
        tl.store(row_ptr + ids, tl.full([BLOCK], float("-inf"), tl.float32), mask=(ids < vocab) & (x < cut))


def penalize_(
    out: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    block: int = BLOCK,
) -> None:
    """kernels.reference_processors.penalize_ in one launch."""
    if len(rows) == 0:
        return
    assert out.dtype == torch.float32 and out.stride(-1) == 1 and counts.stride(-1) == 1
    vocab = out.shape[-1]
    prompt = in_prompt.view(torch.uint8)
    _penalize_kernel[(len(rows),)](
        out, out.stride(0), rows, slots, counts, counts.stride(0), prompt, prompt.stride(0),
        presence, frequency, repetition, vocab, BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8,
    )  # fmt: skip


def min_p_(out: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor, block: int = BLOCK) -> None:
    """kernels.reference_processors.min_p_ in one launch."""
    if len(rows) == 0:
        return
    assert out.dtype == torch.float32 and out.stride(-1) == 1
    vocab = out.shape[-1]
    _min_p_kernel[(len(rows),)](
        out, out.stride(0), rows, shift, vocab, BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8
    )
