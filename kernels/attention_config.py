"""The attention kernel's choices: tile shapes per path, head size and cache dtype, and the split-KV count.

Every choice here is the outcome of a measurement; the measurements themselves (per-shape timings on an H100
and an H200) are in docs/kernels.md, section "Tuning history", under the name of the constant they set.
`kernels/triton_attention.py` launches with these; a caller (the benchmark) passes its own `AttentionConfig`
to try another choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

# How the split-KV partial results of a decode batch become the output:
#   "fused": the last split program of each (sequence, KV head) combines them inside the attention launch;
#   "separate": a second kernel (`_combine_splits_kernel`) combines them, as prefill splits always do;
#   "none": not combined at all, the output left unwritten (the benchmark's probe of the attention alone).
SplitCombine = Literal["fused", "separate", "none"]


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch options of the attention kernel."""

    block_m: int  # query rows per program (tokens x query heads of one KV group), a power of 2 >= 16
    tile_n: int  # cached tokens per inner iteration, a power of 2 >= 16
    num_warps: int
    num_stages: int
    # Decode only: each program loads its next K/V tile into registers before the current tile's math (one
    # tile ahead, by hand) instead of through the compiler's shared-memory pipeline (num_stages then 1).
    register_prefetch: bool = False
    # Split-KV only: where the splits are combined; "fused" applies to decode batches (prefill and mixed
    # batches with splits use the separate kernel either way).
    combine: SplitCombine = "fused"


# Tiles and split counts picked from sweeps on an H100 and an H200 (docs/kernels.md, "Tuning history").
DECODE_CONFIG = AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=2)
# Split-KV decode (few programs, each reading a short stretch): tiles of 8 KB per KV head prefetched one
# ahead in registers: 1-20% faster at every split shape measured (docs/kernels.md, "DECODE_SPLIT_CONFIG").
DECODE_SPLIT_CONFIG = AttentionConfig(
    block_m=16, tile_n=32, num_warps=4, num_stages=1, register_prefetch=True
)
DECODE_SPLIT_CONFIG_SMALL_HEADS = AttentionConfig(
    block_m=16, tile_n=64, num_warps=4, num_stages=1, register_prefetch=True
)
PREFILL_CONFIG = AttentionConfig(block_m=128, tile_n=32, num_warps=4, num_stages=3)
# Head size <= 64: half the bytes per row, so longer KV tiles and more, shorter query blocks
# (docs/kernels.md, "PREFILL_CONFIG_SMALL_HEADS").
PREFILL_CONFIG_SMALL_HEADS = AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2)
# FP8 caches at head sizes above 64: tiles of 128 tokens (the bytes of a bf16 tile of 64) and 3 stages
# (docs/kernels.md, "DECODE_CONFIG_FP8"); at head size 64 they lost at batch 8-64, so DECODE_CONFIG there.
DECODE_CONFIG_FP8 = AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=3)
# Prefill over FP8 caches: every query block converts the K/V tiles it reads, so longer tiles and (at head
# size 64) taller query blocks with 8 warps (docs/kernels.md, "PREFILL_CONFIG_FP8").
PREFILL_CONFIG_FP8 = AttentionConfig(block_m=128, tile_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIG_FP8_SMALL_HEADS = AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=2)


MAX_HEAD_DIM = 256


def padded_head_dim(head_dim: int) -> int:
    """The kernels' tile width for `head_dim`: its next power of 2, at least 16 (`tl.dot`'s smallest inner
    dimension). Raises ValueError for a head size the kernels do not take: not a multiple of 8 (rows then
    break the 16-byte alignment of half-precision vector loads) or above MAX_HEAD_DIM (the tiles would not
    fit in registers and shared memory with the configurations below)."""
    if head_dim <= 0 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head size {head_dim} is not supported by the Triton attention kernels: "
            f"a multiple of 8 up to {MAX_HEAD_DIM} is"
        )
    return max(16, 1 << (head_dim - 1).bit_length())


def decode_config(head_dim: int, fp8: bool, split: bool = False) -> AttentionConfig:
    """The tiles of the decode path for this head size (the padded one: `padded_head_dim`) and cache dtype,
    split-KV or not."""
    if fp8 and head_dim > 64:
        return DECODE_CONFIG_FP8
    if split:
        return DECODE_SPLIT_CONFIG if head_dim > 64 else DECODE_SPLIT_CONFIG_SMALL_HEADS
    return DECODE_CONFIG


def prefill_config(head_dim: int, fp8: bool = False) -> AttentionConfig:
    """The tiles of the prefill / mixed path for this (padded) head size and cache dtype."""
    if fp8:
        return PREFILL_CONFIG_FP8_SMALL_HEADS if head_dim <= 64 else PREFILL_CONFIG_FP8
    return PREFILL_CONFIG_SMALL_HEADS if head_dim <= 64 else PREFILL_CONFIG


# Split-KV: about this many decode programs per multiprocessor, each split holding at least
# _MIN_SPLIT_TOKENS; at head sizes above 64, batches of up to twice that many programs still split in two,
# which shortens the last wave. Split counts are powers of 2 (any count balances with the tiles dealt
# round-robin, but none measured better: docs/kernels.md, "Split counts").
_SPLIT_PROGRAMS_PER_SM = 4
_MIN_SPLIT_TOKENS = 128
_MAX_SPLITS = 32  # more splits measured slower (docs/kernels.md, "Split counts")
# FP8 caches with half-precision queries: products in fp16 (the query converted once), whose conversion
# from e4m3 is one instruction per pair of values on Hopper; bf16 takes a detour through fp32.
FP8_DOTS_IN_FP16 = True


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits, so the automatic choice is exercised there too


def choose_num_splits(
    device: torch.device, num_seqs: int, num_kv_heads: int, max_seq_len: int, head_dim: int
) -> int:
    """Splits of the KV range per decode program: enough programs to fill the GPU when the batch is small,
    none when the batch alone fills it or the contexts are short."""
    programs = num_seqs * num_kv_heads
    target = _SPLIT_PROGRAMS_PER_SM * _num_sms(device)
    splits = min(target // programs, max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS)
    if splits < 2:
        # Two splits shorten the last wave of a batch a little larger than the GPU holds at once. Programs of
        # head size 64 take half the shared memory, twice as many run at once and there is no such wave:
        # splitting them only adds the partials (docs/kernels.md, "Split counts").
        holds_all = head_dim <= 64
        short = max_seq_len < 4 * _MIN_SPLIT_TOKENS
        return 2 if programs < 2 * target and not short and not holds_all else 1
    return 1 << (splits.bit_length() - 1)
