"""Decode attention over our paged KV cache with torch's flex_attention: a baseline to compare the Triton
kernel against (what a user would write instead of a custom kernel).

flex_attention has no notion of a block table, so the paging goes into a BlockMask. All physical pages of
the pool form ONE key/value sequence of batch 1 (`to_flex_pool`: `[1, Hkv, num_pages * page_size, D]`),
flex's KV block size is the page size, and each query row b (one decode token per sequence, batch B,
broadcast against the batch-1 pool) lists its sequence's physical pages as the KV blocks it visits:

    full blocks:    the completely filled pages, in order; flex skips the mask_mod on them.
    partial blocks: the partly filled last page, if any; the mask_mod keeps its first `len % page_size`
                    tokens (it only runs on partial blocks, so the position test alone is enough).

    mask = paged_block_mask(block_tables, seq_lens, num_pages, page_size)
    k, v = to_flex_pool(k_cache), to_flex_pool(v_cache)
    out = flex_paged_decode(query, k, v, mask, scale=head_dim**-0.5)  # [B, Hq, D]

The order of pages within a sequence does not matter to the softmax, and decode needs no causal mask: the
one query token is the last position and sees the whole context.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# flex_attention's query block size; decode has one query row, so any value >= 1 gives one Q block.
_Q_BLOCK = 128

# Recompiles the compiled flex_attention may make (batch sizes, pool sizes, dtypes) before dynamo gives up
# and runs it eagerly, which for flex means a dense, unfused and much slower fallback.
_RECOMPILE_LIMIT = 64

# compute_q_blocks=False skips building the transposed (Q-block) mask, which only the backward pass reads
# and which is large here (B x num_pages); ask for it only where this torch version takes the argument.
_FROM_KV_BLOCKS_KWARGS: dict[str, Any] = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


def paged_block_mask(
    block_tables: torch.Tensor,  # [B, max_pages] int32, padded with anything
    seq_lens: torch.Tensor,  # [B] int, context lengths >= 1
    num_pages: int,  # physical pages in the pool
    page_size: int,
) -> BlockMask:
    """The BlockMask under which query row b attends to exactly the first `seq_lens[b]` tokens of its
    sequence in a `to_flex_pool` pool, read through `block_tables[b]`. Built without a loop over sequences
    (nor a host sync) on the tables' device."""
    device = block_tables.device
    lens = seq_lens.to(device=device, dtype=torch.int32)
    num_full = lens // page_size  # [B] completely filled pages
    fill = lens % page_size  # [B] tokens in the partial last page, 0 if there is none

    # The index tensors' last dim must be the number of KV blocks of the pool (flex builds a dense
    # [rows, num_pages] mask from them), so the table is cut or zero padded to num_pages columns.
    table = block_tables[:, :num_pages].to(torch.int32)
    table = F.pad(table, (0, num_pages - table.shape[1]))
    cols = torch.arange(num_pages, device=device, dtype=torch.int32)
    # Padding entries may hold anything (other sequences' pages, out-of-range ids): zero them so no index
    # past a count can point outside the pool.
    full_idx = torch.where(cols < num_full[:, None], table, 0)  # [B, num_pages]

    has_partial = fill > 0
    # The partial page is entry num_full of the table; clamp for sequences that end on a page boundary
    # (their gathered id is unused) and may have no entry there.
    last = table.gather(1, num_full.clamp(max=num_pages - 1)[:, None].long())  # [B, 1]
    partial_idx = torch.where((cols == 0) & has_partial[:, None], last, 0)  # [B, num_pages]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        # kv_idx is a position in the whole pool; its offset within the page decides, on partial pages only.
        return (kv_idx % page_size) < fill[b]

    # Shapes [B, H, num_q_blocks(, num_kv_blocks)] with H = 1: every head shares the mask (broadcast).
    return BlockMask.from_kv_blocks(
        has_partial.to(torch.int32)[:, None, None],
        partial_idx[:, None, None, :],
        num_full[:, None, None],
        full_idx[:, None, None, :],
        BLOCK_SIZE=(_Q_BLOCK, page_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_pages * page_size),
        **_FROM_KV_BLOCKS_KWARGS,
    )


def to_flex_pool(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, num_blocks * block_size, D]
    """A K or V pool indexed `[num_blocks, block_size, Hkv, D]` (either layout of `kernels.reference.kv_pool`)
    as the contiguous batch-1 tensor flex_attention reads: every page of the pool in order, per KV head, so
    that token `i` of page `p` is position `p * block_size + i`. A copy, made once per set of inputs."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    per_head = cache.permute(2, 0, 1, 3)  # [Hkv, num_blocks, block_size, D]
    return per_head.reshape(1, num_kv_heads, num_blocks * block_size, head_dim).contiguous()


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process (uncompiled, it runs a dense, unfused reference)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name and the older one
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
    # dynamic=False: one specialized graph per shape. With automatic dynamic shapes, the recompile for a
    # second batch or pool size failed in inductor's CPU C++ codegen (torch 2.13: `cur_qSplitSize8` not
    # declared), and fixed shapes are what the GPU kernel is benchmarked at anyway.
    return torch.compile(flex_attention, dynamic=False)


def flex_paged_decode(
    query: torch.Tensor,  # [B, Hq, D], one decode token per sequence
    k_pool: torch.Tensor,  # [1, Hkv, num_pages * page_size, D] from to_flex_pool
    v_pool: torch.Tensor,  # [1, Hkv, num_pages * page_size, D]
    block_mask: BlockMask,  # from paged_block_mask
    scale: float,
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention of each sequence's token to its paged context, through the compiled flex_attention.
    Each KV head serves Hq / Hkv consecutive query heads (GQA). `kernel_options` goes to flex as is: on a GPU
    the flex decoding kernel may need {"BLOCK_N": page_size} to match the mask's 16-token KV blocks."""
    out = _compiled_flex()(
        query.unsqueeze(2),  # [B, Hq, 1, D]
        k_pool,
        v_pool,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        kernel_options=kernel_options,
    )
    return out.squeeze(2)
