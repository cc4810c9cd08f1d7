"""Fixtures for the Triton kernel tests: where kernels can run, and random paged batches.

Kernels run on the CPU through Triton's interpreter when TRITON_INTERPRET=1 (as `scripts/test` and CI set
it), else on CUDA when there is a GPU; otherwise the kernel tests are skipped. Tests marked `gpu` run at
full model shapes on CUDA only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pagedserve.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET


def gpu(test: Callable) -> Callable:
    """Marks a full-shape test `gpu` and skips it without CUDA (or under the interpreter)."""
    needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA, TRITON_INTERPRET unset")
    return pytest.mark.gpu(needs_cuda(test))


# ||out - ref|| / ||ref|| allowed per sequence, by dtype of the query and cache.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture
def device() -> torch.device:
    """The device small-shape kernel tests run on: the CPU under the interpreter, else CUDA."""
    if INTERPRET:
        return torch.device("cpu")
    if HAS_CUDA:
        return torch.device("cuda")
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (as scripts/test sets) or a CUDA device")


@dataclass
class PagedBatch:
    """A flattened batch of query chunks over random contexts stored through shuffled block tables."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64, the slots of the query tokens
    scale: float

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def attention_args(self) -> dict:
        return {
            "query": self.query,
            "k_cache": self.k_cache,
            "v_cache": self.v_cache,
            "block_tables": self.block_tables,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
            "scale": self.scale,
        }


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    layout: str = "head",
) -> PagedBatch:
    """Random K/V everywhere in the pool (unused slots too, so reads past a context show up), block tables
    that are a random permutation of the pool, padded with blocks of other sequences. `layout`: the pool's
    blocks in memory, "head"-major as the worker keeps them or "token"-major (a contiguous
    `[num_blocks, block_size, Hkv, D]`); the kernels must take both."""
    assert all(0 < q <= n for q, n in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, i = [], 0
    for b, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        table = perm[i : i + blocks_per_seq[b]]
        i += blocks_per_seq[b]
        block_tables[b, : len(table)] = table.int()
        block_tables[b, len(table) :] = perm[(i + 1) % num_blocks]
        pos = torch.arange(n - q, n)
        slots.append(table[pos // block_size] * block_size + pos % block_size)

    # Drawn on the target device: full-shape caches are too large to draw quickly on the CPU.
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    def rand_cache() -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
        return reference.kv_pool(
            lambda shape: rand(*shape), num_blocks, block_size, num_kv_heads, head_dim, layout
        )

    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=rand(sum(q_lens), num_heads, head_dim),
        k_cache=rand_cache(),
        v_cache=rand_cache(),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        slot_mapping=torch.cat(slots).to(device),
        scale=head_dim**-0.5,
    )


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """The `make_paged_batch` factory."""
    return make_paged_batch


def assert_close_per_sequence(
    out: torch.Tensor,  # [T, Hq, D]
    ref: torch.Tensor,  # [T, Hq, D], higher precision
    query_start_loc: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Every element written (no NaN left from the poison) and each sequence within its relative error."""
    assert torch.isfinite(out).all(), "output has non-finite elements (unwritten or overflowed)"
    starts = query_start_loc.tolist()
    out, ref = out.double().cpu(), ref.double().cpu()
    for b in range(len(starts) - 1):
        o, r = out[starts[b] : starts[b + 1]], ref[starts[b] : starts[b + 1]]
        err = ((o - r).norm() / r.norm()).item()
        assert err < REL_TOL[dtype], f"sequence {b}: relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"
