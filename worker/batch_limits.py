"""The decode batch the worker is sized for when `--max-num-seqs` is left at 0: it follows the KV pool.

A fixed cap wastes the memory that tensor parallelism frees: at TP=2 each rank holds half the weights and
half of every token's KV, so the pool holds about twice the tokens of one GPU's, and a cap of 512 sequences
left it half used (docs/benchmarks.md, issue 25). The default is one seat per TOKENS_PER_SEAT tokens of the
pool (a sequence of the standard offline workload ends at 800 tokens on average), in steps of 64, within
[MIN_AUTO, MAX_AUTO]: never below the old fixed default, and bounded above because each seat costs a CUDA
graph's worth of buffers, the sampler's [B, V] logits and the memory profile's largest step.
"""

from __future__ import annotations

from pagedserve.common.config import DEFAULT_MAX_NUM_SEQS

TOKENS_PER_SEAT = 1024
MIN_AUTO = DEFAULT_MAX_NUM_SEQS  # 512
MAX_AUTO = 1024
STEP = 64


def auto_max_num_seqs(num_kv_blocks: int, block_size: int) -> int:
    """The default max_num_seqs of a pool of `num_kv_blocks` blocks of `block_size` tokens."""
    seats = num_kv_blocks * block_size // TOKENS_PER_SEAT // STEP * STEP
    return max(MIN_AUTO, min(MAX_AUTO, seats))


def resolve_max_num_seqs(configured: int, num_kv_blocks: int, block_size: int) -> int:
    """`configured` where set (> 0), else the pool's default."""
    if configured < 0:
        raise ValueError(f"max_num_seqs must be at least 0 (0: follow the KV pool), got {configured}")
    return configured or auto_max_num_seqs(num_kv_blocks, block_size)


def profile_max_num_seqs(configured: int) -> int:
    """The most sequences a step may run, before the pool exists (for the memory profile)."""
    return configured or MAX_AUTO
