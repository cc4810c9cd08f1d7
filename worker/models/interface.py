"""What the rest of the worker sees of a model family: `CausalLM`, the forward cut into the pieces around each
layer's attention, and the class attributes through which the loader reads a checkpoint of the family.

The runner (worker/model_runner.py) calls the whole forward and `compute_logits`; the piecewise CUDA graphs
(worker/cuda_graphs.py `MixedGraphs`) capture everything but the attention proper, so they call the pieces
one at a time: `embed`, then per layer i `attention_inputs` (norms, q/k/v projection, RoPE), `attend` (the
KV write and the attention kernel, run eagerly between graphs), `attention_outputs` (output projection, the
MLP), and at the end `final_norm`. The residual stream is carried beside each piece's output and added by the
next norm, so a piece takes and returns (hidden, residual), whose sum is the usual hidden state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel import ParallelContext

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [num_blocks, block_size, Hkv, D]


@dataclass(frozen=True)
class AttentionShape:
    """The attention heads of one layer on this tensor-parallel rank (all of them at size 1)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class WeightMap:
    """How a family's checkpoint tensors land in its parameters, and how tensor parallelism splits them.

    Names are the checkpoint's after `prefix`; a projection is the second-to-last part of a name
    (`layers.3.self_attn.q_proj.weight` -> `q_proj`). Sizes are names of ModelConfig fields or properties,
    read from a rank's own shape (worker/parallel.py `shard_model_config`)."""

    prefix: str  # dropped from every checkpoint name ("model.")
    # checkpoint projection -> (the model's fused projection, index of its rows within it), in row order
    fused: Mapping[str, tuple[str, int]]
    column_parallel: Mapping[str, str]  # projection split by output rows -> the size of a rank's rows
    row_parallel: Mapping[str, str]  # projection whose weight is split by input columns -> a rank's columns
    embedding: str  # the token embedding, split by vocabulary rows
    lm_head: str  # the output projection, split likewise; tied to `embedding` where the checkpoint has none
    skipped: tuple[str, ...] = ()  # names containing one of these are not loaded (rotary inv_freq buffers)
    # projections the checkpoint stores fused already (Phi-3's qkv_proj, gate_up_proj) -> the sizes of their
    # parts in row order; under tensor parallelism a rank takes its rows of each part (its q, k and v heads)
    packed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Mixture of experts: a per-expert checkpoint projection (`...experts.<e>.<proj>.weight`) -> (the experts'
    # stacked parameter [E, rows, cols] beside it, `...experts.<stacked>`, index of its moe_intermediate_size
    # rows within the expert's). Tensor parallelism splits the rows, or for projections also in
    # `row_parallel` (the down projection) the input columns, by the rank's moe_intermediate_size.
    experts: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # checkpoint module path -> the model's, wherever it is whole parts of a name (Mixtral's
    # `block_sparse_moe` is the layer's `mlp`; Qwen2-MoE's `shared_expert.gate_proj` is `shared_gate_proj`)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def model_name(self, checkpoint_name: str) -> str:
        """A checkpoint tensor's name as the model's parameters are named: without `prefix`, renamed."""
        name = checkpoint_name.removeprefix(self.prefix)
        if self.renamed:
            dotted = f".{name}."
            for old, new in self.renamed.items():
                dotted = dotted.replace(f".{old}.", f".{new}.")
            name = dotted[1:-1]
        return name

    def fused_shards(self, fused: str) -> int:
        """How many checkpoint projections make up the fused projection `fused` (0: not a fused one)."""
        return Counter(name for name, _ in self.fused.values())[fused]

    def expert_blocks(self, stacked: str) -> int:
        """How many row blocks of an expert make up the stacked experts' parameter `stacked` (0: none)."""
        return Counter(name for name, _ in self.experts.values())[stacked]

    def shard_sizes(self, fused: str) -> list[str]:
        """The sizes of the parts of fused projection `fused`, in row order."""
        if fused in self.packed:
            return list(self.packed[fused])
        parts = sorted((shard, proj) for proj, (name, shard) in self.fused.items() if name == fused)
        return [self.column_parallel[proj] for _, proj in parts]


class CausalLM(nn.Module, ABC):
    """A decoder-only language model as the worker runs it; one subclass per family (worker/models/).

    Class attributes tell the registry and the loader about the family: the names it is registered under,
    its checkpoint layout, and its config.json quirks (the defaults are Llama's). An instance holds this
    tensor-parallel rank's part of the weights; `config` is the whole model's shape."""

    architectures: ClassVar[tuple[str, ...]] = ()  # config.json "architectures" served by this family
    model_types: ClassVar[tuple[str, ...]] = ()  # config.json "model_type" values; the first is canonical
    weight_map: ClassVar[WeightMap]

    attention_shape: AttentionShape  # this rank's

    def __init__(
        self,
        config: ModelConfig,
        max_model_len: int,  # RoPE tables cover positions below it
        backend: AttentionBackend,
        dtype: torch.dtype,  # of the weights and activations
        device: torch.device,
        parallel: ParallelContext | None = None,  # None: the whole model on this device
        fused_ops: bool = False,  # norms, RoPE and the MLP's activation in Triton (kernels/fused_ops.py)
    ) -> None:
        """A subclass builds its modules with uninitialised weights; worker/loader.py `load_weights` fills
        them."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.parallel = parallel or ParallelContext()

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields whose reading differs between families (qkv_bias, o_proj_bias, qk_norm),
        from the raw config.json. A family with a field of its own adds it here, with a default in
        ModelConfig for the others."""
        bias = bool(raw.get("attention_bias", False))
        return {"qkv_bias": bias, "o_proj_bias": bias, "qk_norm": False}

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        """The attention window of the checkpoint's sliding layers, or None when every layer sees all tokens.
        The loader caps max_position_embeddings to it unless the family applies its windows (`layer_windows`
        among its `config_fields`, as every family here does)."""
        return None

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        ...

    @abstractmethod
    def attention_inputs(
        self,
        i: int,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: layer i-1's output, or the embeddings
        residual: torch.Tensor | None,  # [T, H]: the residual stream before `hidden`; None: layer 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to its attention: q [T, Hq, D], k and v [T, Hkv, D] (RoPE applied), and the residual
        stream [T, H] (which a fused norm may have updated in place)."""

    @abstractmethod
    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, q_size]
        """Layer i's attention proper: writes k, v into the cache at the batch's slots and attends over each
        sequence's cached tokens. The only piece that reads `meta` and the cache."""

    @abstractmethod
    def attention_outputs(
        self,
        i: int,
        attended: torch.Tensor,  # [T, q_size]
        residual: torch.Tensor,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention: the layer's output and the residual stream, [T, H] each."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:  # [T, H]
        """The norm of the last layer's output plus the residual stream (None: there were no layers)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V], on every rank
        ...

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],  # one per layer
    ) -> torch.Tensor:  # [T, H], after the final norm
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        hidden = self.embed(token_ids)
        residual = None
        for i, kv_cache in enumerate(kv_caches):
            q, k, v, residual = self.attention_inputs(i, positions, hidden, residual)
            hidden, residual = self.attention_outputs(i, self.attend(i, q, k, v, kv_cache, meta), residual)
        return self.final_norm(hidden, residual)


def uniform_windows(raw: dict[str, Any], window: int | None) -> dict[str, Any]:
    """`layer_windows` for a config whose every layer slides over `window` (none: {})."""
    return {"layer_windows": (window,) * int(raw["num_hidden_layers"])} if window else {}
