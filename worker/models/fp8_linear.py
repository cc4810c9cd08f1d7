"""Linear projections with FP8 (e4m3) weights, and the helpers through which the shared layers build and call
every projection, quantized or not.

An `Fp8Linear` keeps one float32 scale per output row, whatever the checkpoint's scheme: a per-tensor scale
is broadcast over its projection's rows and a per-channel one copied, so fused projections (q/k/v, gate/up)
whose shards came with different per-tensor scales need no requantization, and a tensor-parallel rank takes
its rows' scales as it takes its rows. Block-wise scales (`weight_block_size`) are applied at load: the
weight is dequantized in float32 and, where it runs in FP8, requantized per row (one more rounding, of the
same size as the checkpoint's own).

Where it runs: on CUDA with compute capability >= 9.0 (Hopper) and bf16 activations, the weight stays FP8
and the product is `torch._scaled_mm` with row-wise scales: each token's activations are scaled by their
own absolute maximum and cast to e4m3 at run time (no host sync, so CUDA graphs capture it). Everywhere else
(the CPU, older GPUs, float32/float16) the weight is dequantized once at load into the model dtype and the
product is the plain matmul, so results there match the dequantized checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import reference_fp8
from pagedserve.worker.models.interface import WeightMap
from pagedserve.worker.models.quantization import QuantConfig
from pagedserve.worker.parallel import ParallelContext, row_parallel_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = reference_fp8.MIN_SCALE  # an all-zero row keeps a finite scale


def fp8_matmul_supported(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] FP8 weight runs as FP8 products here (else it is dequantized at load): on
    Hopper or later (torch's row-wise scaled matmul), with bf16 activations (what it writes), and sizes that
    its kernels take (multiples of 16)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or rows % 16 or cols % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, C] -> e4m3 [R, C], [R]
    """Symmetric e4m3 quantization with one float32 scale per row (the dequantized row is q * scale)."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Activation(NamedTuple):
    """An activation already quantized per token for an FP8 projection, by the kernel that computed it (the
    fused RMSNorm or SiLU-and-mul of worker/models/layers.py): the bits `quantize_activation` would give."""

    data: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T, 1] float32


def runs_fp8(proj: nn.Module) -> bool:
    """Whether `proj` runs FP8 products (so it takes an Fp8Activation)."""
    return isinstance(proj, Fp8Linear) and proj.fp8_matmul


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] -> [M, K], [M, 1]
    """Per-token e4m3 activations with their float32 scales: one Triton launch on CUDA
    (kernels/fp8_quant.py), the PyTorch reference elsewhere (the same bits)."""
    if x.is_cuda:
        from pagedserve.kernels import fp8_quant  # on demand: a CPU worker needs no Triton

        return fp8_quant.quantize_per_token(x)
    return reference_fp8.quantize_per_token(x)


def scaled_mm_per_token(
    x: torch.Tensor | Fp8Activation,  # [..., K] bf16, or [T, K] already quantized
    weight: torch.Tensor,  # [N, K] e4m3, row-major (its transpose is the column-major operand)
    weight_scale: torch.Tensor,  # [1, N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype | None = None,  # None: x's dtype (a bf16 x)
) -> torch.Tensor:  # [..., N]
    """x @ (weight * weight_scale).T with x quantized to e4m3 per token (row) on the fly, unless it comes
    quantized."""
    if isinstance(x, Fp8Activation):
        xq, x_scale = x
        lead = x.data.shape[:-1]
        assert out_dtype is not None
    else:
        xq, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        lead, out_dtype = x.shape[:-1], out_dtype or x.dtype
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=out_dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


class Fp8Linear(nn.Module):
    """A projection whose weight is FP8 with a float32 scale per output row; `shard_rows`: the rows of
    each checkpoint projection fused into it, in order (one entry when it is not fused).

    The loader (worker/loader.py) copies the checkpoint's weight into `weight` (e4m3 for a quantized
    checkpoint, the model dtype for `--quantization fp8`) and hands each scale tensor to `load_scale`;
    `finalize` then fixes how it runs (module docstring)."""

    def __init__(
        self,
        rows: int,
        cols: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantConfig,
        shard_rows: Sequence[int],
    ) -> None:
        super().__init__()
        assert sum(shard_rows) == rows, (shard_rows, rows)
        self.quant: QuantConfig | None = quant
        self.dtype = dtype
        self.shard_rows = list(shard_rows)
        weight_dtype = FP8 if quant.pre_quantized else dtype
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=weight_dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), False) if bias else None
        self.register_buffer("weight_scale", torch.ones(rows, device=device), persistent=False)  # [rows]
        # shard -> (this rank's part of its block-scale grid, the rank's first row and column in the blocks)
        self._blocks: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._scaled: set[int] = set()  # shards whose weight scale has been loaded
        self.fp8_matmul = False  # set by finalize

    def keep_unquantized(self) -> None:
        """A module the checkpoint leaves unquantized (its `ignore` list): plain, in the model dtype."""
        self.quant = None
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=self.dtype), False)

    def _rows_of(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_rows[:shard])
        return start, start + self.shard_rows[shard]

    def load_scale(
        self,
        kind: str,  # the checkpoint tensor's last name part: weight_scale, weight_scale_inv, input_scale, ...
        tensor: torch.Tensor,  # as the checkpoint stores it, whole
        shard: int,  # which of the fused projections it belongs to
        rows: slice | None,  # the checkpoint rows of the weight that this rank holds (None: all)
        cols: slice | None,  # likewise its columns (a row-parallel rank's)
    ) -> None:
        """Takes one scale tensor of this projection. Activation scales are not used (module docstring)."""
        if kind not in ("weight_scale", "weight_scale_inv"):
            return
        if self.quant is None:
            raise ValueError(f"a {kind} for a projection the quantization_config leaves unquantized")
        start, end = self._rows_of(shard)
        n_rows, n_cols = end - start, self.weight.shape[1]
        scale = tensor.to(device=self.weight_scale.device, dtype=torch.float32)
        if self.quant.weight_strategy == "block":
            assert self.quant.block_size is not None
            bm, bn = self.quant.block_size
            r0 = (rows.start or 0) if rows is not None else 0
            c0 = (cols.start or 0) if cols is not None else 0
            grid = scale.reshape(scale.shape[-2], scale.shape[-1])
            grid = grid[r0 // bm : -(-(r0 + n_rows) // bm), c0 // bn : -(-(c0 + n_cols) // bn)]
            self._blocks[shard] = (grid, r0 % bm, c0 % bn)
        elif scale.numel() == 1:
            self.weight_scale[start:end] = scale.reshape(())
        else:
            per_row = scale.reshape(-1)
            if rows is not None:
                per_row = per_row[rows]
            if per_row.numel() != n_rows:
                raise ValueError(f"{kind} of {tuple(tensor.shape)} for a projection of {n_rows} rows")
            self.weight_scale[start:end] = per_row
        self._scaled.add(shard)

    @torch.no_grad()
    def finalize(self) -> None:
        """After loading: FP8 weight and [1, rows] scales where FP8 products run, else the dequantized weight
        in the model dtype."""
        if self.quant is None:
            return
        if self.quant.pre_quantized:
            missing = sorted(set(range(len(self.shard_rows))) - self._scaled)
            if missing:
                raise ValueError(f"FP8 weight without its weight_scale (fused shards {missing})")
        run_fp8 = fp8_matmul_supported(self.weight.device, self.dtype, *self.weight.shape)
        if not self.quant.pre_quantized:
            q, scale = quantize_rows(self.weight)
        elif self.quant.weight_strategy == "block":
            q, scale = self._requantize_blocks(run_fp8)
        else:
            q, scale = self.weight.data, self.weight_scale
        if run_fp8:
            self.weight = nn.Parameter(q, False)
            self.weight_scale = scale.float().reshape(1, -1).contiguous()
        else:
            self.weight = nn.Parameter((q.float() * scale.float()[:, None]).to(self.dtype), False)
        self.fp8_matmul = run_fp8
        self._blocks.clear()

    def _requantize_blocks(self, run_fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-scaled weight, dequantized in float32 shard by shard; requantized per row if it runs
        in FP8, else returned with unit scales."""
        assert self.quant is not None and self.quant.block_size is not None
        bm, bn = self.quant.block_size
        out = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        n_cols = self.weight.shape[1]
        for shard, (grid, r_off, c_off) in self._blocks.items():
            start, end = self._rows_of(shard)
            full = grid.repeat_interleave(bm, 0)[r_off : r_off + end - start]
            full = full.repeat_interleave(bn, 1)[:, c_off : c_off + n_cols]
            out[start:end] = self.weight[start:end].float() * full
        if run_fp8:
            return quantize_rows(out)
        return out, torch.ones(out.shape[0], device=out.device)

    def forward(self, x: torch.Tensor | Fp8Activation, add_bias: bool = True) -> torch.Tensor:  # [T, rows]
        bias = self.bias if add_bias else None
        if self.fp8_matmul:
            return scaled_mm_per_token(x, self.weight, self.weight_scale, bias, self.dtype)
        assert not isinstance(x, Fp8Activation), "an FP8 activation for a projection without FP8 products"
        return F.linear(x, self.weight, bias)


def make_linear(
    rows: int,
    cols: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None,
    shard_rows: Sequence[int] = (),
) -> nn.Module:
    """A projection's parameter holder: `weight` [rows, cols] and `bias` [rows] (or None), plain or, with
    `quant`, an Fp8Linear (`shard_rows`: its fused parts' rows; default one part)."""
    if quant is not None:
        return Fp8Linear(rows, cols, bias, dtype, device, quant, shard_rows or [rows])
    proj = nn.Module()
    proj.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)
    proj.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), False) if bias else None
    return proj


def linear(x: torch.Tensor | Fp8Activation, proj: nn.Module) -> torch.Tensor:
    """x @ proj.weight.T + proj.bias, in FP8 where `proj` runs so."""
    if isinstance(proj, Fp8Linear):
        return proj(x)
    return F.linear(x, proj.weight, proj.bias)


def row_parallel(x: torch.Tensor | Fp8Activation, proj: nn.Module, ctx: ParallelContext) -> torch.Tensor:
    """worker/parallel.py `row_parallel_linear` for a plain or FP8 projection."""
    if not isinstance(proj, Fp8Linear):
        return row_parallel_linear(x, proj.weight, proj.bias, ctx)
    if ctx.world_size == 1:
        return proj(x)
    return ctx.all_reduce(proj(x, add_bias=ctx.rank == 0))


def row_parallel_partial(
    x: torch.Tensor | Fp8Activation, proj: nn.Module, ctx: ParallelContext
) -> torch.Tensor:
    """`row_parallel`, or where worker/tp_fused.py's path takes it (a plain weight, a message that fits its
    buffer), this rank's partial sum written into symmetric memory and left pending: only `add_norm`
    (worker/models/layers.py) may consume it, which sums it over the ranks."""
    rp = ctx.row_parallel
    if rp is None or isinstance(proj, Fp8Linear) or not rp.takes(x, proj.weight):
        return row_parallel(x, proj, ctx)
    return rp.matmul(x, proj.weight, proj.bias if ctx.rank == 0 else None)


def prepare_fp8_linears(model: nn.Module, weights: WeightMap) -> None:
    """Before loading: the projections the checkpoint's `ignore` list names become plain ones. A fused
    projection must be ignored whole (its parts share one weight)."""
    inverse: dict[str, list[str]] = {}
    for proj, (fused, _) in sorted(weights.fused.items(), key=lambda item: item[1][1]):
        inverse.setdefault(fused, []).append(proj)
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear) or module.quant is None or not module.quant.ignored:
            continue
        parent, proj = name.rsplit(".", 1)
        parts = [weights.prefix + f"{parent}.{p}" for p in inverse.get(proj, [proj])]
        ignored = [module.quant.is_ignored(p) for p in parts]
        if all(ignored):
            module.keep_unquantized()
        elif any(ignored):
            raise ValueError(f"quantization_config ignores some of {parts} but not all; they are fused")


def finalize_fp8_linears(model: nn.Module) -> None:
    """After loading: every Fp8Linear settles how it runs (Fp8Linear.finalize)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finalize()
