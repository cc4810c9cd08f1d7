"""The model families the worker serves, found by a checkpoint's config.json `architectures` or `model_type`.

Adding a family is one file in worker/models/ and one line in FAMILIES below (docs/models.md has the
checklist).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.gemma2 import Gemma2ForCausalLM
from pagedserve.worker.models.gemma3 import Gemma3ForCausalLM
from pagedserve.worker.models.interface import CausalLM
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.mistral import MistralForCausalLM
from pagedserve.worker.models.mixtral import MixtralForCausalLM
from pagedserve.worker.models.phi3 import Phi3ForCausalLM
from pagedserve.worker.models.qwen2 import Qwen2ForCausalLM
from pagedserve.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedserve.worker.models.qwen3 import Qwen3ForCausalLM
from pagedserve.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedserve.worker.parallel import ParallelContext

FAMILIES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Phi3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    MixtralForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
)


def _index(names_of: str) -> dict[str, type[CausalLM]]:
    index: dict[str, type[CausalLM]] = {}
    for family in FAMILIES:
        for name in getattr(family, names_of):
            if name in index:
                raise RuntimeError(
                    f"{names_of} {name!r} is claimed by {index[name].__name__} and {family.__name__}"
                )
            index[name] = family
    return index


BY_ARCHITECTURE = _index("architectures")
BY_MODEL_TYPE = _index("model_types")


class UnsupportedModelError(ValueError):
    """A checkpoint of no registered family."""


def resolve_family(
    architectures: Sequence[str], model_type: str, source: str = "config.json"
) -> type[CausalLM]:
    """The family of a checkpoint whose config.json (`source`, for the error) names `architectures` and
    `model_type`: the first registered architecture, else the model type."""
    for name in architectures:
        if name in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[name]
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    named = f" (architectures {', '.join(architectures)})" if architectures else ""
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r}{named} in {source}; "
        f"supported model types: {', '.join(BY_MODEL_TYPE)}; architectures: {', '.join(BY_ARCHITECTURE)}"
    )


def family_of(config: ModelConfig) -> type[CausalLM]:
    """The family of a loaded config (worker/loader.py `load_model_config` sets a model_type it registers)."""
    return resolve_family((), config.model_type)


def build_model(
    config: ModelConfig,
    max_model_len: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext | None = None,
    fused_ops: bool = False,
) -> CausalLM:
    """The model of `config`'s family with uninitialised weights (worker/loader.py `load_weights` fills
    them): this rank's part of it, RoPE tables for positions below `max_model_len`."""
    return family_of(config)(config, max_model_len, backend, dtype, device, parallel, fused_ops)
