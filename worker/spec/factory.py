"""Builds the proposer that `--speculative-config` names (None when speculation is off)."""

from __future__ import annotations

import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.speculative import SpeculativeConfig, parse_speculative_config
from pagedserve.worker.spec.ngram import NgramProposer
from pagedserve.worker.spec.proposer import Proposer
from pagedserve.worker.spec.verify import Speculation


def speculative_config_of(cfg: WorkerConfig) -> SpeculativeConfig | None:
    return parse_speculative_config(cfg.speculative_config)


def build_proposer(
    cfg: WorkerConfig, spec: SpeculativeConfig | None, device: torch.device, dtype: torch.dtype
) -> Proposer | None:
    """The configured proposer; the draft model's module is imported only when it is asked for (it loads a
    second checkpoint and owns its own KV pool)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pagedserve.worker.spec.draft_model import DraftModelProposer  # noqa: PLC0415 (lazy: a model of its own)

    return DraftModelProposer(cfg, spec, device, dtype)


def build_speculation(cfg: WorkerConfig, device: torch.device, dtype: torch.dtype) -> Speculation | None:
    """The model runner's speculation (worker/spec/verify.py), None when `--speculative-config` is empty.
    Built before the target's memory profile and KV pool, so that a draft model's weights and pool are
    counted in the profile's peak; the runner gives it the plan limits once its pool is sized."""
    spec = speculative_config_of(cfg)
    proposer = build_proposer(cfg, spec, device, dtype)
    if spec is None or proposer is None:
        return None
    speculation = Speculation(proposer, None, spec.num_speculative_tokens)
    speculation.ahead.enabled = cfg.speculative_draft_ahead  # (worker/spec/ahead.py)
    return speculation
