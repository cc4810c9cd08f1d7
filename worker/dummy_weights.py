"""Random weights in place of a checkpoint's: the worker's `--load-format dummy` (vLLM's name and meaning).

A benchmark of a model's shape (Qwen3-30B-A3B's 61 GB, Gemma-2-9B's) needs no trained weights, only
weights of the right shapes and dtypes whose activations behave: writing such a checkpoint and reading it
back costs minutes and the disk it fills. With `dummy` the worker reads config.json (and the tokenizer,
generation_config) as for a real load, builds the family's model as the loader would fill it, and draws
every parameter on the device, one tensor at a time, with no CPU copy of the model:

- matrices, embeddings, biases, MoE routers and experts: normal(0, DUMMY_STD) (transformers' default
  initializer_range), so that each projection keeps its input's scale within a small factor, the RMS norms
  bring every layer back to unit scale, and bf16 activations stay finite; the logits come out with a spread
  of about DUMMY_STD * sqrt(hidden_size), neither flat nor saturated, and top-k routing varies by token;
- RMS norms: the identity (1, or 0 where the family scales by 1 + weight: Gemma);
- rotary tables, the embedding scale and such buffers are computed by the modules themselves, as for a real
  load; FP8 KV scales stay 1.0, as for a checkpoint without them;
- FP8 projections: `--quantization fp8` quantizes the random bf16 weight at load as it does a checkpoint's
  (worker/models/fp8_linear.py `finalize`); a config.json whose `quantization_config` says the weights are
  FP8 already gets random weights quantized per output row, with their scales, as an FP8 checkpoint's
  (block-scaled configs too: such a checkpoint is requantized per row at load anyway).

Each parameter is drawn from a generator seeded by `--seed` and the parameter's name, so a model is the same
whatever order its parameters are drawn in, and every tensor-parallel rank draws only its own shard: the
parameters every rank holds whole (norms, routers, row-parallel biases) come out equal on every rank, as the
model needs. The last rank's padding rows of a split vocabulary are zero, as the loader leaves them.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.fp8_linear import (
    FP8,
    Fp8Linear,
    finalize_fp8_linears,
    prepare_fp8_linears,
    quantize_rows,
)
from pagedserve.worker.models.interface import CausalLM
from pagedserve.worker.models.layers import RMSNorm
from pagedserve.worker.parallel import ParallelContext

DUMMY_STD = 0.02  # the standard deviation of every random matrix (transformers' initializer_range)


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` for the worker's `--seed`: the same on every rank. 32 bits:
    the CPU's generator (mt19937) keeps no more of a seed."""
    return zlib.crc32(f"{seed}/{name}".encode())


@torch.no_grad()
def init_dummy_weights(
    model: CausalLM,
    config: ModelConfig,
    seed: int = 0,
    parallel: ParallelContext | None = None,
) -> None:
    """Fills `model` (built by worker/models/registry.py `build_model`, parameters on the target device) with
    random weights (module docstring), where worker/loader.py `load_weights` would copy a checkpoint's."""
    weights = model.weight_map
    prepare_fp8_linears(model, weights)  # a config.json ignore list keeps its projections unquantized
    norms = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    fp8 = {
        f"{name}.weight": m
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear) and m.quant is not None and m.quant.pre_quantized
    }
    params = dict(model.named_parameters())  # a tied LM head is the embedding: drawn once
    generator = torch.Generator(device=next(iter(params.values())).device)
    for name, param in params.items():
        if name in norms:
            param.fill_(0.0 if norms[name].unit_offset else 1.0)
            continue
        generator.manual_seed(parameter_seed(seed, name))
        if name in fp8:
            _draw_fp8(fp8[name], generator)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
    _zero_vocab_padding(model, config, parallel)
    finalize_fp8_linears(model)


def _draw_fp8(module: Fp8Linear, generator: torch.Generator) -> None:
    """An FP8 checkpoint's projection: a random weight in the model dtype, quantized per output row, handed
    to the module with its scales as the loader hands a checkpoint's."""
    assert module.quant is not None
    if module.quant.weight_strategy == "block":  # per-row scales instead of a block grid (module docstring)
        module.quant = dataclasses.replace(module.quant, weight_strategy="channel", block_size=None)
    drawn = torch.empty(module.weight.shape, dtype=module.dtype, device=module.weight.device)
    q, scale = quantize_rows(drawn.normal_(0.0, DUMMY_STD, generator=generator))
    assert module.weight.dtype == FP8
    module.weight.copy_(q)
    start = 0
    for shard, rows in enumerate(module.shard_rows):
        module.load_scale("weight_scale", scale[start : start + rows], shard, None, None)
        start += rows


def _zero_vocab_padding(model: CausalLM, config: ModelConfig, parallel: ParallelContext | None) -> None:
    """The rows of the embedding and the LM head past the vocabulary (the last rank's padding) are zero."""
    if parallel is None or parallel.world_size == 1:
        return
    start, rows = parallel.vocab_shard(config.vocab_size)
    real = max(0, min(rows, config.vocab_size - start))
    for name in (model.weight_map.embedding, model.weight_map.lm_head):
        model.get_parameter(name)[real:].zero_()
