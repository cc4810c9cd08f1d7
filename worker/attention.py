"""The attention interface the model calls, and the backends behind it.

Every layer hands its new keys and values, its queries, its cache and the step's `AttentionMetadata` to one
`AttentionBackend.forward`; a backend decides how to store the keys and values and how to attend: "torch"
is the PyTorch reference (kernels/reference.py, any device), "triton" the Triton kernels (kernels/
triton_attention.py and kernels/cache_ops.py, CUDA), which the worker picks on a GPU. Both live here, beside
the interface: the Triton backend imports its kernels when it is made, so the worker imports on machines
without Triton, and the kernels import nothing from the worker (the dependency goes one way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import reference


@dataclass
class AttentionMetadata:
    """Where a flattened batch's tokens go in the KV cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token (block_id * block_size + offset)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's tokens start in the batch
    max_query_len: int  # longest chunk in the batch
    max_seq_len: int  # longest context in the batch
    num_decode_seqs: int = 0  # the batch's first sequences with one query token each (decodes come first)


class AttentionBackend(ABC):
    """Stores a layer's new keys/values in its paged cache and attends from the queries through it."""

    name: str
    graph_safe: bool = False  # no host syncs in forward: a decode step can be captured in a CUDA graph

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # FP8 caches: per-tensor scales (kernels/reference.py)
        v_scale: float = 1.0,
        sliding_window: int = 0,  # the layer's window (kernels/reference.py); 0: it sees every token
        softcap: float = 0.0,  # the layer's score soft-cap; 0: none
    ) -> torch.Tensor:  # [T, Hq, D]
        """Window and soft-cap are the layer's constants (not in `meta`, which is per step): a CUDA graph
        replays each layer with its own."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError, naming the size and what is supported, if this backend cannot attend over heads
        of `head_dim` values: called when a model is built, so that the worker refuses at start. The
        default takes any size."""
        return None


class TorchReferenceBackend(AttentionBackend):
    """The PyTorch reference in kernels/reference.py: any device, correctness first."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        reference.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return reference.paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            k_scale, v_scale, sliding_window, softcap,
        )  # fmt: skip


class TritonBackend(AttentionBackend):
    """Paged attention through Triton kernels: the slot-write kernel, then one attention launch per layer.

    The kernel picks its path from host-side metadata, with no device sync (so a step can be captured in a
    CUDA graph): a batch whose chunks are all one token (`max_query_len == 1`) takes the decode path, which
    splits long contexts over several programs when the batch alone would leave the GPU idle; any other
    batch (prefills, chunked prefills) takes the unified path; a mixed batch sends its leading decodes down
    the decode path and the rest down the unified one (two launches). The kernels run on CUDA tensors, or on
    CPU tensors under TRITON_INTERPRET=1 (slowly; that is how the tests run them).
    """

    name = "triton"
    graph_safe = True

    def __init__(self) -> None:
        # Imported on first use: the worker must import on machines without Triton.
        from pagedserve.kernels import cache_ops, triton_attention

        self._write_kv = cache_ops.write_kv
        self._paged_attention = triton_attention.paged_attention

    def check_head_dim(self, head_dim: int) -> None:
        from pagedserve.kernels.attention_config import padded_head_dim

        padded_head_dim(head_dim)  # a multiple of 8 up to 256 (padded in registers, never in the cache)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        self._write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self._paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            num_decode_seqs=meta.num_decode_seqs, k_scale=k_scale, v_scale=v_scale,
            sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchReferenceBackend,
    "triton": TritonBackend,
}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """The backend registered under `name`."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
