"""The checkpoint's sampling defaults: what its `generation_config.json` says a request that leaves a field
out should sample with, as vLLM's `--generation-config auto` reads it (ApiConfig.generation_config).

As vLLM, the values are those transformers' `GenerationConfig.from_pretrained(...).to_diff_dict()` reports
(with transformers 5, whose defaults are all None, every value the file sets), and only temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (the max_tokens of a chat request that has none; a
completion's is 16 either way, as in vLLM, where max_new_tokens caps requests only when given by
--override-generation-config). `do_sample` is not read, as in vLLM. A value outside the range a request
may ask for is logged at startup and left out.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.common.log import get_logger
from pagedserve.common.sampling_params import MAX_PENALTY

log = get_logger(component="api.generation_config")
FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults for the fields a request leaves out; None: the api's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens: a chat request's default

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _in_range(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if name == "temperature":
        return 0.0 <= value <= 100.0
    if name == "top_p":
        return 0.0 < value <= 1.0
    if name == "top_k":
        return isinstance(value, int) and -1 <= value < 2**31
    if name == "min_p":
        return 0.0 <= value <= 1.0
    if name == "repetition_penalty":
        return 0.0 < value <= MAX_PENALTY
    return isinstance(value, int) and 1 <= value < 2**31  # max_tokens


def load_generation_defaults(root: str, mode: str) -> GenerationDefaults:
    """The defaults of the checkpoint directory `root` under `mode` ("auto" reads its generation_config.json,
    "none" keeps the api's own); no file, or one transformers cannot read, gives none."""
    if mode == "none" or not os.path.isfile(os.path.join(root, FILE_NAME)):
        return GenerationDefaults()
    from transformers import GenerationConfig  # only here: the api imports transformers lazily

    try:
        diff = GenerationConfig.from_pretrained(root).to_diff_dict()
    except (OSError, ValueError) as e:
        log.error("generation_config_unreadable", model=root, error=str(e)[:200])
        return GenerationDefaults()
    values: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"):
        value = diff.get(name)
        if value is None:
            continue
        key = "max_tokens" if name == "max_new_tokens" else name
        if _in_range(key, value):
            values[key] = value
        else:
            log.error("generation_config_value_out_of_range", model=root, field=name, value=repr(value)[:40])
    defaults = GenerationDefaults(**values)
    if values:
        log.info("generation_config_defaults", model=root, **defaults.as_dict())
    return defaults
