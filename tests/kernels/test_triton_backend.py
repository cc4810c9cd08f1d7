"""TritonBackend behind the AttentionBackend interface: the same cache writes and outputs as the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.worker.attention import AttentionMetadata, TorchReferenceBackend, get_attention_backend
from tests.kernels.conftest import PagedBatch, assert_close_per_sequence, gpu, make_paged_batch


def _meta(batch: PagedBatch) -> AttentionMetadata:
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))  # as worker/inputs.py counts
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        num_decode_seqs=leading,
    )


def _check_backend(batch: PagedBatch) -> None:
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim = batch.query.shape[0], *batch.k_cache.shape[2:]
    key, value = (
        torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(batch.query) for _ in range(2)
    )
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, batch.slot_mapping)
    up = torch.float64 if batch.query.device.type == "cpu" else torch.float32
    expected = TorchReferenceBackend().forward(
        batch.query.to(up), key, value, k_ref.to(up), v_ref.to(up), _meta(batch), batch.scale
    )

    out = backend.forward(batch.query, key, value, batch.k_cache, batch.v_cache, _meta(batch), batch.scale)

    assert torch.equal(batch.k_cache, k_ref) and torch.equal(batch.v_cache, v_ref)
    assert_close_per_sequence(out, expected, batch.query_start_loc, batch.query.dtype)


@pytest.mark.parametrize("kind", ["decode", "mixed", "decodes-first"])
def test_triton_backend_matches_reference_backend(device: torch.device, kind: str) -> None:
    seq_lens = [5, 40, 1, 300, 17]
    q_lens = {"decode": [1] * 5, "mixed": [5, 1, 1, 20, 17], "decodes-first": [1, 1, 1, 20, 17]}[kind]
    _check_backend(make_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, device=device, seed=4))


@pytest.mark.parametrize("head_dim", [64, 96])
def test_triton_backend_matches_reference_backend_at_head_sizes(device: torch.device, head_dim: int) -> None:
    # The slot write and attention at a head size padded in registers (96) beside a power of 2.
    seq_lens, q_lens = [5, 40, 1, 30, 17], [1, 1, 1, 20, 17]
    _check_backend(make_paged_batch(seq_lens, q_lens, 8, 2, head_dim, 16, device=device, seed=head_dim))


def test_backends_say_which_head_sizes_they_take() -> None:
    triton_backend = get_attention_backend("triton")
    for head_dim in (8, 64, 80, 96, 112, 128, 160, 256):
        triton_backend.check_head_dim(head_dim)
    for head_dim in (100, 12, 264):
        with pytest.raises(ValueError, match=f"head size {head_dim} is not supported by the Triton"):
            triton_backend.check_head_dim(head_dim)
    TorchReferenceBackend().check_head_dim(100)  # the reference takes any


@gpu
@pytest.mark.parametrize("kind", ["decode", "mixed", "decodes-first"])
def test_gpu_triton_backend_full_shapes(kind: str) -> None:
    seq_lens = [1500, 9, 4000, 1, 777, 2048]
    q_lens = {"decode": [1] * 6, "mixed": [1, 9, 1, 1, 500, 2048], "decodes-first": [1, 1, 1, 1, 500, 2048]}[
        kind
    ]
    _check_backend(make_paged_batch(seq_lens, q_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=4))
