"""Quantized checkpoints: what a config.json `quantization_config` says, read into `QuantConfig`.

FP8 weights (float8 e4m3) are the one supported kind, in the three on-disk layouts people publish:

- `quant_method: "fp8"` (transformers' FineGrainedFP8, vLLM's and AutoFP8's): `weight` in e4m3 with either
  `weight_scale_inv` over blocks of `weight_block_size` (DeepSeek-V3, Qwen3-FP8) or one per-tensor
  `weight_scale` (AutoFP8; `weight_scale_inv` when transformers wrote it without blocks); `input_scale`
  where `activation_scheme` is static. Skipped modules: `modules_to_not_convert` or `ignored_layers`.
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (llm-compressor's FP8 schemes):
  `config_groups` whose `weights` are `{type: float, num_bits: 8, strategy: tensor | channel | block}`,
  tensors `weight` + `weight_scale` (one number, `[out, 1]`, or a block grid), optional `input_scale`;
  skipped modules: `ignore` (names or `re:` patterns).
- `quant_method: "fbgemm_fp8"`: per-channel `weight_scale` `[out, 1]` and an `input_scale_ub`.

Every scale here is a dequantization multiplier: the real weight is `weight.float() * scale` (the `_inv` of
`weight_scale_inv` is the quantizer's point of view). Activation scales from the checkpoint are read and
not used: activations are quantized per token at run time (worker/models/fp8_linear.py), which is at least
as accurate as one static scale.

`--quantization fp8` (WorkerConfig.quantization) quantizes a bf16/float32 checkpoint's linear weights at
load, one scale per output channel, and runs them the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_METHODS = ("fp8",)
WeightStrategy = Literal["tensor", "channel", "block"]
# Checkpoint tensors that belong to a quantized linear beside its `weight` (and `bias`).
SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub", "activation_scale")
WEIGHT_SCALE_NAMES = ("weight_scale", "weight_scale_inv")


class UnsupportedQuantizationError(ValueError):
    """A `quantization_config` (or --quantization) of a method or scheme the worker cannot run."""


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear weights are quantized: FP8 e4m3 with `weight_strategy` scales."""

    source: str  # the checkpoint's quant_method ("fp8", "compressed-tensors", "fbgemm_fp8"), or "online"
    weight_strategy: WeightStrategy  # one scale per tensor, per output channel, or per weight block
    block_size: tuple[int, int] | None = None  # [rows, cols] of a weight block, with strategy "block"
    activation_scheme: str = "dynamic"  # the checkpoint's; execution always scales activations per token
    ignored: tuple[str, ...] = ()  # checkpoint module names (or `re:` patterns) kept unquantized

    @property
    def pre_quantized(self) -> bool:
        """Whether the checkpoint's weights are FP8 already (else they are quantized at load)."""
        return self.source != "online"

    def is_ignored(self, module: str) -> bool:
        """Whether checkpoint module `module` (e.g. `model.layers.0.mlp.down_proj`) stays unquantized."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False


ONLINE_FP8 = QuantConfig(source="online", weight_strategy="channel")


def _refuse(method: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"quantization method {method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)}"
    )


def parse_quantization_config(raw: dict[str, Any] | None) -> QuantConfig | None:
    """The QuantConfig of a config.json `quantization_config` (None: not quantized). Raises
    UnsupportedQuantizationError, naming the method, for anything but the FP8 layouts above."""
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        block = raw.get("weight_block_size")
        ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
        return QuantConfig(
            source="fp8",
            weight_strategy="block" if block else "tensor",
            block_size=(int(block[0]), int(block[1])) if block else None,
            activation_scheme=str(raw.get("activation_scheme", "dynamic")),
            ignored=tuple(ignored),
        )
    if method == "fbgemm_fp8":
        return QuantConfig(
            source="fbgemm_fp8",
            weight_strategy="channel",
            ignored=tuple(raw.get("modules_to_not_convert") or ()),
        )
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    raise _refuse(method or "<none>")


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    fmt = raw.get("format", "dense")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors ({fmt})")
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            kind = f"{weights.get('type')}{weights.get('num_bits')}"
            raise _refuse(f"compressed-tensors ({kind} weights)")
        block = weights.get("block_structure")
        schemes.add((weights.get("strategy", "tensor"), tuple(block) if block else None))
        acts = group.get("input_activations") or {}
        activation = "dynamic" if acts.get("dynamic", True) else "static"
    if len(schemes) > 1:  # one scheme per model: mixed groups are refused rather than guessed
        raise _refuse(f"compressed-tensors (mixed weight strategies {sorted(s for s, _ in schemes)})")
    ((strategy, block),) = schemes
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"compressed-tensors (FP8 {strategy} strategy)")
    return QuantConfig(
        source="compressed-tensors",
        weight_strategy=strategy,
        block_size=(int(block[0]), int(block[1])) if block else None,
        activation_scheme=activation,
        ignored=tuple(raw.get("ignore") or ()),
    )


def quantization_from_flag(flag: str, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The quantization a worker runs with: the checkpoint's, else `--quantization` (`fp8`: quantize the
    checkpoint's linear weights at load). A flag of another method is refused by name."""
    if not flag:
        return checkpoint
    if flag not in SUPPORTED_METHODS:
        raise _refuse(flag)
    return checkpoint or ONLINE_FP8
