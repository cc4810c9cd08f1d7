"""The PyTorch reference of kernels/processors.py: the logits processors' two rules over the whole vocabulary
(worker/logits_processors.py), in place on the rows they name. What the worker runs off CUDA."""

from __future__ import annotations

import torch


def penalize_(
    out: torch.Tensor,  # [R, V] float32, changed in place
    rows: torch.Tensor,  # [N] int64 distinct rows of `out`
    slots: torch.Tensor,  # [N] int64 their TokenHistory slots
    counts: torch.Tensor,  # [S, V] int32 how often each token was generated
    in_prompt: torch.Tensor,  # [S, V] bool the prompt holds the token
    presence: torch.Tensor,  # [N] float32
    frequency: torch.Tensor,  # [N] float32
    repetition: torch.Tensor,  # [N] float32
) -> None:
    """vLLM's penalties: repetition over prompt and output tokens (a positive logit divided by it, a
    negative one multiplied), then frequency times the count and presence once per generated token."""
    x = out.index_select(0, rows)
    count = counts.index_select(0, slots)  # [N, V] int32
    generated = count > 0
    seen = generated | in_prompt.index_select(0, slots)
    factor = torch.where(seen, repetition[:, None], 1.0)
    x = torch.where(x > 0, x / factor, x * factor)
    x -= frequency[:, None] * count
    x -= presence[:, None] * generated
    out.index_copy_(0, rows, x)


def min_p_(
    out: torch.Tensor,  # [R, V] float32, changed in place
    rows: torch.Tensor,  # [M] int64 distinct rows
    shift: torch.Tensor,  # [M] float32 temperature * ln(min_p) (< 0)
) -> None:
    """-inf for the tokens whose logit is below the row's largest plus `shift` (min_p in logit space)."""
    x = out.index_select(0, rows)
    cut = x.amax(dim=-1, keepdim=True) + shift[:, None]
    out.index_copy_(0, rows, x.masked_fill_(x < cut, float("-inf")))
