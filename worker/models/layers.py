"""The layers that the model families share: RMSNorm, rotary embeddings (worker/models/rotary.py), attention
(fused q/k/v projection, the paged attention proper, the output projection) and the gated MLP, each with its
tensor-parallel split.

The batch is every scheduled token of every sequence, concatenated (`[T]`); attention finds each sequence's
context through `AttentionMetadata`. The numerics follow transformers' LlamaForCausalLM (RMSNorm in float32,
neox-style rotate-half RoPE with cos/sin cast to the model dtype) so that float32 logits agree closely.
Parameter names follow the checkpoints' (`qkv_proj` and `gate_up_proj` are the fused ones); the loader
(worker/loader.py `load_weights`) fills them through the family's `WeightMap`.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from pagedserve.kernels import reference_ops
from pagedserve.worker.attention import AttentionBackend, AttentionMetadata
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.fp8_linear import (
    Fp8Activation,
    linear,
    make_linear,
    row_parallel,
    row_parallel_partial,
    runs_fp8,
)
from pagedserve.worker.models.interface import KVCache

# rope_inv_freq: re-exported for the callers that import the shared layers from here
from pagedserve.worker.models.rotary import RotaryEmbedding, rope_inv_freq  # noqa: F401
from pagedserve.worker.parallel import ParallelContext

# With fused ops, the RMSNorm before a projection with FP8 products and the SiLU-and-mul before an FP8 down
# projection write e4m3 and per-token scales instead of bf16 (kernels/fused_ops.py, bit-identical to
# quantizing their bf16 result): one pass over the activation fewer. Tests switch it off to compare.
FP8_EPILOGUES = True


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the checkpoint, and initialising large weights is slow.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 whatever the model dtype; `fused`: one Triton kernel
    (kernels/fused_ops.py) instead of the PyTorch ops."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        unit_offset: bool = False,  # Gemma: scaled by (1 + weight), in float32, then cast (gemma_rms_norm)
    ) -> None:
        super().__init__()
        self.weight = param(size, dtype=dtype, device=device)
        self.eps = eps
        self.unit_offset = unit_offset  # the identity weight is 0, else 1 (worker/dummy_weights.py)
        self.fp8_fusable = fused and not unit_offset  # can write e4m3 for an FP8 projection (FP8_EPILOGUES)
        if unit_offset:  # no fused kernel for it: the PyTorch ops, also with --fused-ops
            self._norm = gemma_rms_norm
        else:
            self._norm = _fused_ops().rms_norm if fused else reference_ops.rms_norm

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Activation:  # [..., H]
        """With `fp8` (for an FP8 projection of a [T, H] `x`), quantized per token where it can be fused."""
        if fp8 and self.fp8_fusable and FP8_EPILOGUES:
            return Fp8Activation(*_fused_ops().rms_norm_fp8(x, self.weight, self.eps)[:2])
        return self._norm(x, self.weight, self.eps)[0]

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, fp8: bool = False
    ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """The norm of x + residual, and x + residual (the new residual; the fused kernel writes it into
        `residual` in place). `fp8`: as in `forward`."""
        if fp8 and self.fp8_fusable and FP8_EPILOGUES:
            q, scale, residual = _fused_ops().rms_norm_fp8(x, self.weight, self.eps, residual)
            assert residual is not None
            return Fp8Activation(q, scale), residual
        out, residual = self._norm(x, self.weight, self.eps, residual)
        assert residual is not None
        return out, residual


def add_norm(
    hidden: torch.Tensor,  # [T, H]: the sum to add, or a partial sum that `row_parallel_partial` left pending
    residual: torch.Tensor,  # [T, H]
    norm: RMSNorm,
    ctx: ParallelContext,
    fp8: bool = False,  # the norm feeds a projection with FP8 products (RMSNorm.forward)
) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """`norm.add(hidden, residual)`, where a pending partial sum is first summed over the ranks: in one kernel
    with the add and the norm in the fused mode (worker/tp_fused.py), else torch's one-shot all-reduce."""
    rp = ctx.row_parallel
    if rp is None or not rp.is_pending(hidden):
        return norm.add(hidden, residual, fp8)
    if ctx.all_reduce_trace is not None:
        ctx.all_reduce_trace.append((hidden.numel() * hidden.element_size(), rp.mode))
    fusable = norm._norm is not gemma_rms_norm and residual.is_contiguous() and residual.dtype == hidden.dtype
    if rp.fuse_norm and fusable:
        return rp.reduce_add_rms_norm(hidden, residual, norm.weight, norm.eps)
    return norm.add(rp.reduce(hidden), residual, fp8)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`reference_ops.rms_norm` with Gemma's numerics: the stored weight is an offset from 1, and the
    product is taken in float32 before the cast to the model dtype (transformers' Gemma2RMSNorm)."""
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype), residual


# config.json `hidden_activation` (or `hidden_act`) of a GELU-gated MLP (Gemma) -> F.gelu's `approximate`
GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def _fused_ops() -> types.ModuleType:
    """kernels.fused_ops, imported on demand: without --fused-ops the worker needs no Triton."""
    from pagedserve.kernels import fused_ops

    return fused_ops


class Attention(nn.Module):
    """Self-attention with fused q/k/v projection and grouped KV heads. `config` is this rank's shape: with
    tensor parallelism, its heads only; o_proj's partial outputs are summed over the ranks."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        fused: bool,
        sliding_window: int = 0,  # this layer's window; 0: it sees every token
        softcap: float = 0.0,  # this layer's score soft-cap (Gemma 2); 0: none
        scale: float | None = None,  # the score scale; None: head_dim ** -0.5
    ) -> None:
        super().__init__()
        self.config = config
        backend.check_head_dim(config.head_dim)
        self.backend = backend
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.parallel = parallel
        kw = {"dtype": dtype, "device": device}
        qkv_rows = config.q_size + 2 * config.kv_size
        quant, shards = config.quantization, [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = make_linear(
            qkv_rows, config.hidden_size, config.qkv_bias, **kw, quant=quant, shard_rows=shards
        )
        self.o_proj = make_linear(config.hidden_size, config.q_size, config.o_proj_bias, **kw, quant=quant)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:  # Qwen3: one norm over head_dim, shared by every head of q (and of k)
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device, fused)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device, fused)
        self.scale = config.head_dim**-0.5 if scale is None else scale
        # What one unit of an FP8 cache's stored K (V) is worth: the checkpoint's self_attn.k_scale
        # (v_scale) where it has them (worker/loader.py `load_weights`), else 1.0. Other caches store
        # values as they are.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def takes_fp8(self) -> bool:
        """Whether `project` takes its input quantized (an FP8 qkv_proj)."""
        return runs_fp8(self.qkv_proj)

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor | Fp8Activation, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k and v [T, Hkv, D]
        """Queries, keys and values of `hidden` [T, H], with q/k norms (Qwen3) and RoPE applied."""
        c = self.config
        qkv = linear(hidden, self.qkv_proj)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, q_size]
        """Writes k, v into the cache at the batch's slots and attends over each sequence's cached tokens."""
        out = self.backend.forward(  # [T, Hq, D]
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale,
            self.sliding_window, self.softcap,
        )  # fmt: skip
        return out.reshape(-1, self.config.q_size)

    def output(self, attended: torch.Tensor) -> torch.Tensor:  # [T, q_size] -> [T, H]
        return row_parallel(attended, self.o_proj, self.parallel)


class GatedMLP(nn.Module):
    """Gated feed-forward with fused gate/up projection (with tensor parallelism, this rank's rows of it;
    down_proj's partial outputs are summed over the ranks): SwiGLU, or GELU-gated where
    `config.hidden_activation` names a GELU (Gemma)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        fused: bool,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        if config.hidden_activation != "silu":
            approximate = GELU_APPROXIMATE[config.hidden_activation]
            self._act_and_mul = functools.partial(reference_ops.gelu_and_mul, approximate=approximate)
        else:
            self._act_and_mul = _fused_ops().silu_and_mul if fused else reference_ops.silu_and_mul
        self._fp8_act_and_mul = fused and config.hidden_activation == "silu"  # can write e4m3 for down_proj
        kw = {"dtype": dtype, "device": device}
        inter = config.intermediate_size
        quant, bias = config.quantization, config.mlp_bias
        self.gate_up_proj = make_linear(
            2 * inter, config.hidden_size, bias, **kw, quant=quant, shard_rows=[inter, inter]
        )
        self.down_proj = make_linear(config.hidden_size, inter, bias, **kw, quant=quant)

    def takes_fp8(self) -> bool:
        """Whether `forward` takes its input quantized (an FP8 gate_up_proj)."""
        return runs_fp8(self.gate_up_proj)

    def forward(self, x: torch.Tensor | Fp8Activation, partial: bool = False) -> torch.Tensor:  # [T, H]
        """With `partial`, the output may be this rank's pending partial sum (`row_parallel_partial`)."""
        gate_up = linear(x, self.gate_up_proj)
        if self._fp8_act_and_mul and FP8_EPILOGUES and runs_fp8(self.down_proj):
            x = Fp8Activation(*_fused_ops().silu_and_mul_fp8(gate_up))
        else:
            x = self._act_and_mul(gate_up)
        if partial:
            return row_parallel_partial(x, self.down_proj, self.parallel)
        return row_parallel(x, self.down_proj, self.parallel)
