"""Mistral: Llama's layers and checkpoint layout; v0.1 slides every layer's attention over a window (served to
the full context with the window applied, as transformers does)."""

from __future__ import annotations

from typing import Any

from pagedserve.worker.models.interface import uniform_windows
from pagedserve.worker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """A Mistral causal LM: a Llama whose config may name a sliding window for all layers."""

    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_fields(raw), **uniform_windows(raw, cls.sliding_window(raw))}

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        window = raw.get("sliding_window")  # null from Mistral v0.2 on; 4096 in v0.1, for every layer
        return int(window) if window else None
