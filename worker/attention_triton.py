"""The Triton attention backend: the slot-write kernel, then paged attention over the block tables.

Imported lazily by `worker.attention` so that the worker imports on machines without Triton. The kernels run
on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slowly; that is how the tests run them).
"""

from __future__ import annotations

import torch

from kernels import cache_ops, triton_attention
from worker.attention import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    """Paged attention through Triton kernels, one attention launch per layer and step.

    The kernel picks its path from host-side metadata, with no device sync (so a step can be captured in a
    CUDA graph): a batch whose chunks are all one token (`max_query_len == 1`) takes the decode path, which
    splits long contexts over several programs when the batch alone would leave the GPU idle; any other
    batch (prefills, chunked prefills) takes the unified path; a mixed batch sends its leading decodes down
    the decode path and the rest down the unified one (two launches).
    """

    name = "triton"
    graph_safe = True

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, Hq, D]
        cache_ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return triton_attention.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_decode_seqs=meta.num_decode_seqs,
            k_scale=k_scale,
            v_scale=v_scale,
        )
