"""The window the worker announces to the scheduler (WorkerReady.sliding_window): when every layer of the
model slides, the scheduler frees the KV blocks that fall wholly behind the smallest window
(docs/scheduler.md, "Sliding windows"). A model with a global layer (Gemma 2/3 alternate them with windowed
ones) reads every block, so it announces 0 and keeps them all. So does a worker with a draft model
(speculative decoding): the draft keeps a sequence's whole context in its own pool, sized like the target's,
so a sequence may not outgrow the target's pool either."""

from __future__ import annotations

from typing import Any

from pagedserve.worker.model_config import ModelConfig


def freeing_window(model_config: ModelConfig, speculation: Any = None) -> int:
    """The smallest window over the model's layers, or 0 when one of them (or a draft model) reads all."""
    if getattr(getattr(speculation, "proposer", None), "model_config", None) is not None:
        return 0  # a draft model: its own pool holds what the target's could
    windows = model_config.layer_windows or (0,)  # (): every layer global
    return min(windows) if min(windows) > 0 else 0
