"""Reads a local Hugging Face checkpoint of a registered model family (worker/models/registry.py): its config,
and its weights into the worker's own modules.

The parts of config.json every family reads alike are worker/model_config.py's. What differs between
families (attention biases, q/k norms, sliding windows, checkpoint names) the family's class says
(`config_fields`, `sliding_window`, `weight_map`); this module applies it. A family whose layers apply their
windows (`layer_windows` among its config fields: every family here, Gemma's, Mistral v0.1's, Phi-3's, Qwen's
with use_sliding_window) is served to its full length; a family that named a window without applying it
would attend as full layers do, exact only within the window, so the loader would cap
max_position_embeddings to the window.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.worker.model_config import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    ModelConfig,
    as_id_list,
    read_json,
    rope_max_positions,
    rope_settings,
)
from pagedserve.worker.models.fp8_linear import Fp8Linear, finalize_fp8_linears, prepare_fp8_linears
from pagedserve.worker.models.interface import CausalLM, WeightMap
from pagedserve.worker.models.quantization import (
    SCALE_NAMES,
    parse_quantization_config,
    quantization_from_flag,
)
from pagedserve.worker.models.registry import BY_MODEL_TYPE, resolve_family
from pagedserve.worker.parallel import ParallelContext

# Per-layer scales of an FP8 KV cache as quantized checkpoints store them (one number each); without them
# the scales stay 1.0 (worker/models/layers.py Attention).
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")


def load_model_config(model_dir: str | Path, quantization: str = "") -> ModelConfig:
    """The ModelConfig of the checkpoint in `model_dir` (config.json, and generation_config.json for EOS);
    `quantization`: WorkerConfig.quantization ("fp8": quantize the weights at load, unless the checkpoint is
    quantized already)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face checkpoint directory")
    raw = read_json(config_path)
    model_type = raw.get("model_type", "llama")
    family = resolve_family(raw.get("architectures") or (), model_type, str(config_path))
    if BY_MODEL_TYPE.get(model_type) is not family:  # found by architecture: the runner finds it by type
        model_type = family.model_types[0]
    theta, scaling = rope_settings(raw)
    eos = ()
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = as_id_list(read_json(gen_path).get("eos_token_id"))
    if not eos:
        eos = as_id_list(raw.get("eos_token_id"))
    num_heads = int(raw["num_attention_heads"])
    raw_max_positions = int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))
    max_position_embeddings = rope_max_positions(raw_max_positions, scaling)
    window = family.sliding_window(raw)
    fields = family.config_fields(raw)  # qkv_bias, o_proj_bias, qk_norm and any of the family's own
    if window is not None and not any(fields.get("layer_windows", ())):
        max_position_embeddings = min(max_position_embeddings, window)
    # A family whose config nests RoPE per layer type (Gemma 3) reads its global one itself.
    theta = fields.pop("rope_theta", theta)
    scaling = fields.pop("rope_scaling", scaling)
    return ModelConfig(
        model_type=model_type,
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=eos,
        quantization=quantization_from_flag(
            quantization, parse_quantization_config(raw.get("quantization_config"))
        ),
        **fields,
    )


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """The names of the checkpoint's tensors, read from the file headers (no tensor data)."""
    names: list[str] = []
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


Slices = tuple[slice, ...]


def iter_checkpoint_tensors(
    model_dir: str | Path,
    device: torch.device,
    select: Callable[[str], Slices | list[Slices] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read one at a time straight onto `device`; where `select`
    gives slices for a name, only that part of the tensor is read (a tensor-parallel rank's shard), and
    where it gives a list of them, those parts one after the other along the first dimension."""
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                slices = select(name) if select is not None else None
                if slices is None:
                    yield name, f.get_tensor(name)
                elif isinstance(slices, list):
                    yield name, torch.cat([f.get_slice(name)[part] for part in slices]).to(device)
                else:
                    yield name, f.get_slice(name)[slices].to(device)


def _fused_target(name: str, weights: WeightMap) -> tuple[str, int] | None:
    """('...qkv_proj.weight', shard) for a checkpoint name that the model stores fused, else None."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in weights.fused:
        fused, shard = weights.fused[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return None


def _expert_target(name: str, weights: WeightMap) -> tuple[str, int, int] | None:
    """('...experts.gate_up_proj', expert, row block) for a per-expert checkpoint tensor, else None."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in weights.experts:
        stacked, block = weights.experts[parts[-2]]
        return ".".join(parts[:-3] + [stacked]), int(parts[-3]), block
    return None


def _shard_rows(config: ModelConfig, weights: WeightMap, fused_name: str, shard: int) -> tuple[int, int]:
    sizes = [getattr(config, size) for size in weights.shard_sizes(fused_name.split(".")[-2])]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def _rank_slices(
    name: str, weights: WeightMap, local: ModelConfig, vocab_rows: int, rank: int, world_size: int
) -> Slices | list[Slices] | None:
    """The part of checkpoint tensor `name` that tensor-parallel rank `rank` holds (None: all of it), given
    the rank's layer shapes `local` and its rows of the vocabulary. Column-parallel projections (weights and
    biases) are split by output rows, row-parallel weights by input columns, the embedding and the LM head
    by vocabulary rows; norms and the row-parallel biases are whole on every rank. A projection stored
    fused (`weights.packed`) is split part by part: the rank's rows of each part, in the parts' order."""
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if _expert_target(name, weights) is not None:  # each expert is split as a dense MLP of its size
        size = local.moe_intermediate_size
        if proj in weights.row_parallel:
            return (slice(None), slice(rank * size, (rank + 1) * size))
        return (slice(rank * size, (rank + 1) * size),)
    if proj in weights.packed:
        slices, start = [], 0
        for rows in (getattr(local, size) for size in weights.packed[proj]):
            slices.append((slice(start + rank * rows, start + (rank + 1) * rows),))
            start += rows * world_size  # the whole part's rows
        return slices
    rows = getattr(local, weights.column_parallel[proj]) if proj in weights.column_parallel else None
    if name in (weights.embedding, weights.lm_head):
        rows = vocab_rows
    if rows is not None:  # the last vocabulary slice may run past the end: the slice stops there
        return (slice(rank * rows, (rank + 1) * rows),)
    if proj in weights.row_parallel and parts[-1] == "weight":
        cols = getattr(local, weights.row_parallel[proj])
        return (slice(None), slice(rank * cols, (rank + 1) * cols))
    return None


def load_weights(
    model: CausalLM,
    config: ModelConfig,
    model_dir: str | Path,
    parallel: ParallelContext | None = None,
) -> None:
    """Copies the checkpoint's tensors into `model` (whose parameters are already on the target device and
    dtype) by its family's `weight_map`: fusing q/k/v and gate/up, stacking the experts of a MoE, and tying
    the LM head to the embedding where the checkpoint says so. With a tensor-parallel `parallel` of more
    than one rank, reads only this rank's shard of each tensor."""
    weights = model.weight_map
    prepare_fp8_linears(model, weights)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[str] = set()
    select = None
    if parallel is not None and parallel.world_size > 1:
        local = parallel.shard_model_config(config)
        vocab_rows = parallel.vocab_shard(config.vocab_size)[1]
        config = local  # the fused rows below are this rank's

        def select(name: str) -> Slices | list[Slices] | None:
            if name.rsplit(".", 1)[-1] in SCALE_NAMES:  # small: read whole, Fp8Linear takes its part
                return None
            model_name = weights.model_name(name)
            return _rank_slices(model_name, weights, local, vocab_rows, parallel.rank, parallel.world_size)

    for ckpt_name, tensor in iter_checkpoint_tensors(model_dir, device, select):
        name = weights.model_name(ckpt_name)
        if any(skipped in name for skipped in weights.skipped):
            continue
        if name.rsplit(".", 1)[-1] in SCALE_NAMES:
            _load_scale(model, weights, ckpt_name, tensor, select)
            continue
        if name == weights.lm_head and config.tie_word_embeddings:
            continue
        if name.endswith(KV_SCALE_NAMES):  # an FP8 KV cache's per-tensor scales: plain floats on the layer
            if tensor.numel() != 1:  # per-head or per-channel scales: not what the kernels apply
                raise ValueError(
                    f"{ckpt_name}: one per-tensor scale expected, got shape {tuple(tensor.shape)}"
                )
            module, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(module), attr, tensor.item())
            continue
        expert = _expert_target(name, weights)
        fused = _fused_target(name, weights)
        if expert is not None:  # one expert's projection: its rows of the experts' stacked parameter
            target_name, index, block = expert
            target = params[target_name][index]  # [rows, cols] of this expert
            if name.split(".")[-2] not in weights.row_parallel:  # gate or up: a block of the rows
                rows = config.moe_intermediate_size
                target = target[block * rows : (block + 1) * rows]
            loaded.add(f"{target_name}#{index}.{block}")
        elif fused is not None:
            target_name, shard = fused
            start, end = _shard_rows(config, weights, target_name, shard)
            target = params[target_name][start:end]
            loaded.add(f"{target_name}#{shard}")
        elif name in params:
            target = params[name]
            loaded.add(name)
            if select is not None and name in (weights.embedding, weights.lm_head):
                with torch.no_grad():  # the last rank's vocabulary slice is padded with zero rows
                    target[tensor.shape[0] :].zero_()
                target = target[: tensor.shape[0]]
        else:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        if target.shape != tensor.shape:
            shapes = f"checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
            raise ValueError(f"{ckpt_name}: shape mismatch: {shapes}")
        if (tensor.dtype == torch.float8_e4m3fn) != (target.dtype == torch.float8_e4m3fn):
            # a copy would cast without the scale: the quantization_config and the tensors disagree
            raise ValueError(f"{ckpt_name}: {tensor.dtype} in the checkpoint for a {target.dtype} parameter")
        with torch.no_grad():
            target.copy_(tensor)

    if weights.lm_head not in loaded:
        # Tied, or a checkpoint that simply has no lm_head: the output projection is the embedding.
        head, attr = weights.lm_head.rsplit(".", 1)
        setattr(model.get_submodule(head), attr, model.get_parameter(weights.embedding))
        loaded.add(weights.lm_head)
    expected = set()
    for name in params:
        shards = weights.fused_shards(name.split(".")[-2]) if "." in name else 0
        blocks = weights.expert_blocks(name.rsplit(".", 1)[-1]) if ".experts." in name else 0
        if blocks:
            num_experts = params[name].shape[0]
            expected.update(f"{name}#{e}.{b}" for e in range(num_experts) for b in range(blocks))
        elif shards:
            expected.update(f"{name}#{i}" for i in range(shards))
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    finalize_fp8_linears(model)


def _load_scale(
    model: CausalLM,
    weights: WeightMap,
    ckpt_name: str,
    tensor: torch.Tensor,
    select: Callable[[str], tuple[slice, ...] | None] | None,
) -> None:
    """Hands a quantized projection's scale tensor (weight_scale, input_scale, ...) to its Fp8Linear, with
    the checkpoint rows and columns of the weight that this rank holds."""
    name = ckpt_name.removeprefix(weights.prefix)
    target, shard = _fused_target(name, weights) or (name, 0)
    module_name, kind = target.rsplit(".", 1)
    module = model.get_submodule(module_name) if _has_submodule(model, module_name) else None
    if not isinstance(module, Fp8Linear):
        raise ValueError(f"checkpoint tensor {ckpt_name!r} scales a projection the model does not quantize")
    slices = select(ckpt_name.rsplit(".", 1)[0] + ".weight") if select is not None else None
    rows, cols = (tuple(slices or ()) + (None, None))[:2]
    try:
        module.load_scale(kind, tensor, shard, rows, cols)
    except ValueError as e:
        raise ValueError(f"{ckpt_name}: {e}") from e


def _has_submodule(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
