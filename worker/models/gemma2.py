"""Gemma 2: Llama's checkpoint layout with Gemma's own numerics, and the layers Gemma 3 shares
(worker/models/gemma3.py subclasses it).

What differs from Llama, each as transformers' Gemma2ForCausalLM has it:
- norms scale by (1 + weight), the product taken in float32 (`gemma_rms_norm`), and each layer has four:
  before and after the attention, before and after the MLP (the "post" norms apply to the block's output,
  before the residual add);
- the embedding is multiplied by sqrt(hidden_size), rounded to the model dtype;
- the MLP's activation is GELU with the tanh approximation (`hidden_activation`);
- scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and soft-capped
  (attn_logit_softcapping: c * tanh(s / c)), and so are the final logits (final_logit_softcapping);
- layers alternate between a sliding window (`sliding_window`, even layers) and global attention; the
  kernels apply the window (kernels/reference.py), so the model is served to its full length. The pool's
  blocks outside the window are not freed: the global layers still read them (docs/models.md).
The LM head is tied to the embedding (the checkpoints have none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.interface import AttentionShape, CausalLM
from pagedserve.worker.models.layers import (
    GELU_APPROXIMATE,
    Attention,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    param,
)
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.parallel import ParallelContext, vocab_parallel_embedding


def gemma_sliding_layers(raw: dict[str, Any], default_pattern: int) -> list[bool]:
    """Which layers slide: `layer_types` where config.json has it, else every layer but each
    `sliding_window_pattern`-th (Gemma 2: 2, the even layers slide; Gemma 3: 6)."""
    num_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return [t == "sliding_attention" for t in layer_types]
    pattern = int(raw.get("sliding_window_pattern") or default_pattern)
    return [bool((i + 1) % pattern) for i in range(num_layers)]


def gemma_config_fields(raw: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 2 / 3 config.json (worker/models/interface.py `config_fields`)."""
    window = int(raw.get("sliding_window") or 0)
    windows = tuple(window if s else 0 for s in gemma_sliding_layers(raw, default_pattern))
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in GELU_APPROXIMATE:
        raise ValueError(
            f"unsupported hidden_activation {activation!r}; supported: {', '.join(GELU_APPROXIMATE)}"
        )
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    bias = bool(raw.get("attention_bias", False))
    return {
        "qkv_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": False,
        "layer_windows": windows if window and any(windows) else (),
        "attn_logit_softcap": float(raw.get("attn_logit_softcapping") or 0.0),
        "final_logit_softcap": float(raw.get("final_logit_softcapping") or 0.0),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or head_dim),
        "hidden_activation": activation,
    }


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP blocks, each between a pre- and a post-norm, with residual connections; the halves
    around the attention proper carry the residual stream beside their output as Llama's do."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        fused: bool,
    ) -> None:
        super().__init__()

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, config.rms_norm_eps, dtype, device, fused, unit_offset=True)

        window = config.layer_windows[layer] if config.layer_windows else 0
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.input_layernorm = norm(config.hidden_size)
        self.self_attn = Attention(
            config, backend, dtype, device, parallel, fused,
            sliding_window=window, softcap=config.attn_logit_softcap, scale=scale,
        )  # fmt: skip
        if config.qk_norm:  # Gemma 3: the q/k norms are Gemma norms too
            self.self_attn.q_norm = norm(config.head_dim)
            self.self_attn.k_norm = norm(config.head_dim)
        self.post_attention_layernorm = norm(config.hidden_size)
        self.pre_feedforward_layernorm = norm(config.hidden_size)
        self.post_feedforward_layernorm = norm(config.hidden_size)
        self.mlp = GatedMLP(config, dtype, device, parallel, fused)

    def attention_inputs(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
        return (*self.self_attn.project(positions, normed, rope), residual)

    def attention_outputs(
        self,
        attended: torch.Tensor,
        residual: torch.Tensor,  # [T, q_size], [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the layer's output and the residual stream, [T, H] each
        attn_out = self.post_attention_layernorm(self.self_attn.output(attended))
        normed, residual = self.pre_feedforward_layernorm.add(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """A Gemma 2 causal LM. Parameter names follow the checkpoint's, minus `model.` (Llama's weight map);
    the Llama pieces (attend, attention_outputs, final_norm) apply unchanged to Gemma's layers."""

    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    sliding_window_pattern = 2  # without `layer_types`: every second layer is global

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
        CausalLM.__init__(self, config, max_model_len, backend, dtype, device, parallel, fused_ops)
        layer_config = self.parallel.shard_model_config(config)
        self.attention_shape = AttentionShape(
            layer_config.num_heads, layer_config.num_kv_heads, layer_config.head_dim
        )
        vocab_rows = self.parallel.vocab_shard(config.vocab_size)[1]
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(layer_config, i, backend, dtype, device, self.parallel, fused_ops)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, fused_ops, unit_offset=True
        )
        self.lm_head = nn.Module()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:  # a checkpoint without lm_head ties it at load (worker/loader.py)
            self.lm_head.weight = param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config, max_model_len, dtype, device, fused_ops)
        self.layer_ropes = self._layer_ropes(config, max_model_len, dtype, device, fused_ops)
        # sqrt(hidden_size) rounded to the model dtype, as transformers multiplies
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5).to(device=device, dtype=dtype),
            persistent=False,
        )

    def _layer_ropes(
        self, config: ModelConfig, max_model_len: int, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> tuple[RotaryEmbedding, ...]:
        """Each layer's RoPE: Gemma 2's is the same for all (Gemma 3 overrides)."""
        return (self.rotary_emb,) * config.num_layers

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return gemma_config_fields(raw, cls.sliding_window_pattern)

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        return int(raw["sliding_window"]) if cls.config_fields(raw)["layer_windows"] else None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return vocab_parallel_embedding(token_ids, self.embed_tokens.weight, self.parallel) * self.embed_scale

    def attention_inputs(
        self, i: int, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layers[i].attention_inputs(positions, hidden, residual, self.layer_ropes[i])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V], on every rank
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits
