"""The window the worker announces to the scheduler (WorkerReady.sliding_window): when every layer of the
model slides, the scheduler frees the KV blocks that fall wholly behind the smallest window
(docs/scheduler.md, "Sliding windows"). A model with a global layer (Gemma 2/3 alternate them with windowed
ones) reads every block, so it announces 0 and keeps them all. A draft model (speculative decoding) reads the
same block tables with its own layers: its windows count too."""

from __future__ import annotations

from typing import Any

from worker.model_config import ModelConfig


def freeing_window(model_config: ModelConfig, speculation: Any = None) -> int:
    """The smallest window over every layer that reads the KV blocks, or 0 when one of them reads all."""
    windows = list(model_config.layer_windows) or [0]  # (): every layer global
    draft_config = getattr(getattr(speculation, "proposer", None), "model_config", None)
    if isinstance(draft_config, ModelConfig):
        windows += list(draft_config.layer_windows) or [0]
    return min(windows) if min(windows) > 0 else 0
