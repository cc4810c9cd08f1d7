"""Rotary position embeddings: the frequencies of every RoPE type that transformers gives these families
(default, linear, llama3, yarn, dynamic NTK, longrope; each computed as transformers' `modeling_rope_utils`
computes it, in float32, so that float32 logits agree closely) and `RotaryEmbedding`, which holds cos/sin
for every position below max_model_len, precomputed (CUDA graphs replay the lookups; no step does host work).

transformers recomputes two types' frequencies in each forward, from the length of the sequence in that
forward (`dynamic_rope_update`). A paged engine rotates each token once, when its key enters the cache, and
batches sequences of every length, so it fixes one rule per position instead:

- **dynamic**: position p is rotated with the frequencies transformers uses for a sequence of p + 1 tokens:
  plain RoPE below config.json's max_position_embeddings, and past it a base that grows with p. That is what
  transformers' `generate` does for every token it generates (each one is the last of its forward), so the
  engine matches it exactly for every sequence within max_position_embeddings and for generation past it
  from a prompt within it. Only a prompt longer than max_position_embeddings differs: transformers rotates
  all of it with the frequencies of its full length (vLLM instead rotates every sequence, short ones too,
  with the frequencies of factor x max_position_embeddings, which matches transformers nowhere below it).
- **longrope** (Phi-3): one set of factors per engine, as vLLM chooses: the long factors when max_model_len
  exceeds the pretraining length (original_max_position_embeddings), else the short ones. With max_model_len
  within the pretraining length this is exactly transformers for every sequence; past it, exactly
  transformers for every sequence longer than the pretraining length (shorter ones transformers rotates with
  the short factors). Switching per sequence would leave the keys already cached rotated the other way.

yarn and longrope multiply cos and sin by an attention factor (the "mscale"), as transformers does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.kernels import reference_ops
from pagedserve.worker.model_config import ModelConfig, RopeScaling


def _exponents(dim: int) -> torch.Tensor:  # [dim/2] float32: 0, 2/dim, 4/dim, ...
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def rope_inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, seq_len: int | None = None
) -> torch.Tensor:  # [dim/2] float32
    """Inverse frequencies of RoPE over the `dim` rotated dimensions of a head, scaled as `scaling` says.
    `seq_len` matters to the types transformers recomputes per forward: dynamic (the sequence's length; None:
    unscaled) and longrope (the long factors past the pretraining length)."""
    if scaling is None:
        return 1.0 / (theta ** _exponents(dim))
    kind = scaling.rope_type
    if kind == "linear":
        return 1.0 / (theta ** _exponents(dim)) / scaling.factor
    if kind == "llama3":
        return _llama3_inv_freq(dim, theta, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    if kind == "dynamic":
        seq_lens = torch.tensor([seq_len or scaling.original_max_position_embeddings])
        return _dynamic_inv_freq(dim, theta, scaling, seq_lens)[0]
    if kind == "longrope":
        use_long = seq_len is not None and seq_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if use_long else scaling.short_factor, dtype=torch.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(f"longrope needs {dim // 2} factors (rotary dim {dim}), got {factors.shape[0]}")
        return 1.0 / (factors * theta ** _exponents(dim))
    raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated.
    inv_freq = 1.0 / (theta ** _exponents(dim))
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Frequencies that turn fewer than beta_slow times over the pretraining length are interpolated (divided
    # by factor), those that turn more than beta_fast times kept, with a linear ramp between.
    def correction_dim(num_rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _dynamic_inv_freq(
    dim: int, theta: float, scaling: RopeScaling, seq_lens: torch.Tensor
) -> torch.Tensor:  # [N] int64 sequence lengths -> [N, dim/2]
    # NTK-aware: the base grows with the sequence past max_position_embeddings. In float32 from the integer
    # lengths, as transformers computes it from the tensor of the forward's longest position.
    original = scaling.original_max_position_embeddings
    seq_lens = torch.clamp(seq_lens.to(torch.int64), min=original)
    base = theta * ((scaling.factor * seq_lens / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim)[None, :])


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What yarn and longrope multiply cos and sin by (1.0 for the other types)."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
    return mscale(factor)


def rope_cos_sin(
    dim: int, theta: float, scaling: RopeScaling | None, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_len, dim] float32, the halves equal
    """The cos and sin of every position below `max_len`, by the rules in the module's docstring."""
    positions = torch.arange(max_len, dtype=torch.float32)
    if scaling is not None and scaling.rope_type == "dynamic":
        # Position p as the last of p + 1 tokens: unscaled up to max_position_embeddings (`original`).
        original = scaling.original_max_position_embeddings
        inv_freq = rope_inv_freq(dim, theta, None).expand(max_len, dim // 2).clone()  # [max_len, dim/2]
        if max_len > original:
            seq_lens = torch.arange(original + 1, max_len + 1)
            inv_freq[original:] = _dynamic_inv_freq(dim, theta, scaling, seq_lens)
        freqs = positions[:, None] * inv_freq
    else:
        inv_freq = rope_inv_freq(dim, theta, scaling, seq_len=max_len)  # longrope: long past the original
        freqs = torch.outer(positions, inv_freq)  # [max_len, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = rope_attention_factor(scaling)
    return emb.cos() * factor, emb.sin() * factor


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE over the first `config.rotary_dim` dimensions of each head (all of them but with a
    partial_rotary_factor), from cos/sin precomputed for every position below `max_len` (`fused`: one Triton
    kernel per tensor, rotating in place)."""

    def __init__(
        self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.fused = fused
        if fused:  # imported on demand: without --fused-ops the worker needs no Triton
            from pagedserve.kernels import fused_ops

            self._rope = fused_ops.rope_
        else:
            self._rope = reference_ops.rope
        self.rotary_dim = config.rotary_dim
        cos, sin = rope_cos_sin(self.rotary_dim, config.rope_theta, config.rope_scaling, max_len)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rotary_dim
        if d == query.shape[-1]:
            return self._rope(positions, query, key, self.cos, self.sin)
        q_rot, k_rot = self._rope(positions, query[..., :d], key[..., :d], self.cos, self.sin)
        if self.fused:  # rotated in place, the rest of each head untouched
            return query, key
        return torch.cat((q_rot, query[..., d:]), dim=-1), torch.cat((k_rot, key[..., d:]), dim=-1)
