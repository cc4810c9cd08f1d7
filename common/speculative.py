"""`--speculative-config`: vLLM's JSON shape, parsed and checked once for every process that reads it.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    --speculative-config '{"method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 4}'

As in vLLM, a `model` without a `method` means a draft model. Unknown keys are refused rather than ignored:
a misspelt knob that silently does nothing is worse than a start that fails with its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import Meta

from pagedserve.common.flags import json_object_of
from pagedserve.common.wire_types import MAX_PLAN_ITEMS

SpeculativeMethod = Literal["ngram", "draft_model"]
MAX_SPECULATIVE_TOKENS = 16  # a verification step's query tokens per sequence stay within a kernel tile
DraftCount = Annotated[int, Meta(ge=0, le=MAX_SPECULATIVE_TOKENS)]  # draft tokens of one sequence in a step
# StepOutput: per sequence, the tokens it emits (1 + accepted drafts) and the drafts it verified
RunLengths = Annotated[
    list[Annotated[int, Meta(ge=1, le=MAX_SPECULATIVE_TOKENS + 1)]], Meta(max_length=MAX_PLAN_ITEMS)
]
DraftCounts = Annotated[list[DraftCount], Meta(max_length=MAX_PLAN_ITEMS)]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer drafts tokens, and how many per sequence and step at most."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    model: str = ""  # draft_model: a checkpoint directory (or repo id) with the target's tokenizer
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched against the sequence's earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest

    def __post_init__(self) -> None:
        if self.method not in get_args(SpeculativeMethod):
            methods = get_args(SpeculativeMethod)
            raise ValueError(f"speculative method must be one of {methods}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "draft_model" and not self.model:
            raise ValueError("a draft_model speculative config needs a model")
        if self.method == "ngram":
            if self.model:
                raise ValueError("the ngram proposer takes no model")
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
                raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The config that `text` (the flag's JSON object) states; None for an empty string. ValueError names what
    is wrong."""
    raw = json_object_of(text, SpeculativeConfig, "speculative config")
    if raw is None:
        return None
    if "method" not in raw:
        raw["method"] = "draft_model" if raw.get("model") else "ngram"
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative config needs num_speculative_tokens")
    for key, value in raw.items():
        want = str if key in ("method", "model") else int
        if not isinstance(value, want) or isinstance(value, bool):
            raise ValueError(f"speculative config {key} must be {want.__name__}")
    return SpeculativeConfig(**raw)
