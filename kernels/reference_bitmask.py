"""The PyTorch reference of kernels/token_bitmask.py (and what the CPU runs): structured output's token
bitmasks applied to the logits rows of the constrained sequences. No Triton here: the worker imports it on
any machine."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # [n, W] int32 -> [n, V] 0/1 uint8
    """The tokens past the words (W * 32 < V: a mask as wide as the tokenizer, not the logits) are 0."""
    data = bitmask.contiguous().view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    shifts = torch.arange(8, device=data.device, dtype=torch.uint8)
    bits = ((data[:, :, None] >> shifts) & 1).view(len(data), -1)[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1])) if bits.shape[1] < vocab else bits


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, kinds: torch.Tensor, extra: torch.Tensor
) -> torch.Tensor:
    """`apply_token_bitmask` in PyTorch ops (a gather and a scatter of the constrained rows)."""
    if len(rows) == 0:
        return logits
    allowed = unpack_bitmask(bitmask & extra.index_select(0, kinds.long()), logits.shape[-1]).bool()
    picked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, picked)
