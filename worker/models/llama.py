"""Llama: pre-norm decoder layers (RMSNorm, attention with grouped KV heads and RoPE, SwiGLU MLP), the
layout that Mistral, Qwen2 and Qwen3 share (worker/models/mistral.py, qwen2.py, qwen3.py subclass it).

Checkpoint names are transformers' LlamaForCausalLM's, with q/k/v and gate/up stored fused. With a
tensor-parallel `parallel` of N ranks (worker/parallel.py), the layers hold this rank's 1/N of the heads and
of the MLP, and the embedding and LM head its slice of the vocabulary (ceil(V/N) rows).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.fp8_linear import row_parallel_partial
from pagedserve.worker.models.interface import AttentionShape, CausalLM, KVCache, WeightMap
from pagedserve.worker.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, add_norm, param
from pagedserve.worker.parallel import ParallelContext, vocab_parallel_embedding, vocab_parallel_logits

LLAMA_WEIGHTS = WeightMap(
    prefix="model.",
    fused={
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    },
    column_parallel={
        "q_proj": "q_size",
        "k_proj": "kv_size",
        "v_proj": "kv_size",
        "gate_proj": "intermediate_size",
        "up_proj": "intermediate_size",
    },
    row_parallel={"o_proj": "q_size", "down_proj": "intermediate_size"},
    embedding="embed_tokens.weight",
    lm_head="lm_head.weight",
    skipped=("rotary_emb",),  # older checkpoints store inv_freq; the worker computes its own
)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each with a residual connection, in two halves around the attention
    proper (worker/models/interface.py): the residual stream is carried beside each half's output and added
    by the next norm (one fused launch)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        fused: bool,
        mlp: nn.Module | None = None,  # the feed-forward block, [T, H] -> [T, H]; None: the dense GatedMLP
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, fused)
        self.self_attn = Attention(config, backend, dtype, device, parallel, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, fused)
        self.mlp = mlp if mlp is not None else GatedMLP(config, dtype, device, parallel, fused)
        self.parallel = parallel

    def attention_inputs(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        fp8 = self.self_attn.takes_fp8()  # the norm writes e4m3 for FP8 products (layers.FP8_EPILOGUES)
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, fp8)
        else:
            normed, residual = add_norm(hidden, residual, self.input_layernorm, self.parallel, fp8)
        return (*self.self_attn.project(positions, normed, rope), residual)

    def attention_outputs(
        self,
        attended: torch.Tensor,
        residual: torch.Tensor,  # [T, q_size], [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the layer's output and the residual stream, [T, H] each
        """Under tensor parallelism the output may be a pending partial sum (worker/tp_fused.py), which the
        next norm (the next layer's first, or the final one) sums over the ranks with its add."""
        attn = row_parallel_partial(attended, self.self_attn.o_proj, self.parallel)
        if isinstance(self.mlp, GatedMLP):
            fp8 = self.mlp.takes_fp8()
            normed, residual = add_norm(attn, residual, self.post_attention_layernorm, self.parallel, fp8)
            return self.mlp(normed, partial=True), residual
        normed, residual = add_norm(attn, residual, self.post_attention_layernorm, self.parallel)
        return self.mlp(normed), residual


class LlamaForCausalLM(CausalLM):
    """A Llama causal LM. Parameter names follow the checkpoint's, minus `model.` (LLAMA_WEIGHTS)."""

    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    weight_map = LLAMA_WEIGHTS

    def __init__(
        self,
        config: ModelConfig,
        max_model_len: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext | None = None,
        fused_ops: bool = False,
    ) -> None:
        super().__init__(config, max_model_len, backend, dtype, device, parallel, fused_ops)
        layer_config = self.parallel.shard_model_config(config)
        self.attention_shape = AttentionShape(
            layer_config.num_heads, layer_config.num_kv_heads, layer_config.head_dim
        )
        vocab_rows = self.parallel.vocab_shard(config.vocab_size)[1]
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            self.make_layer(i, layer_config, backend, dtype, device, fused_ops)
            for i in range(config.num_layers)
        )
        for layer, window in zip(self.layers, config.layer_windows, strict=False):
            layer.self_attn.sliding_window = window  # Mistral v0.1, Phi-3, Qwen with use_sliding_window
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused_ops)
        self.lm_head = nn.Module()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight = param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config, max_model_len, dtype, device, fused_ops)

    def make_layer(
        self,
        i: int,
        config: ModelConfig,  # this rank's shape
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        fused_ops: bool,
    ) -> LlamaDecoderLayer:
        """Decoder layer i; a family whose layers differ in their feed-forward block (MoE) overrides it."""
        return LlamaDecoderLayer(config, backend, dtype, device, self.parallel, fused_ops)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return vocab_parallel_embedding(token_ids, self.embed_tokens.weight, self.parallel)

    def attention_inputs(
        self, i: int, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layers[i].attention_inputs(positions, hidden, residual, self.rotary_emb)

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.layers[i].self_attn.attend(q, k, v, kv_cache, meta)

    def attention_outputs(
        self, i: int, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[i].attention_outputs(attended, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # no layers
            return self.norm(hidden)
        return add_norm(hidden, residual, self.norm, self.parallel)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V], on every rank
        return vocab_parallel_logits(hidden, self.lm_head.weight, self.config.vocab_size, self.parallel)
