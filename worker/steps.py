"""The steps the model runner has in flight: one launched on the device (`LaunchedStep`), one whose forward is
queued and whose sampler is not yet (`ForwardedStep`), and the per-step columns they are built from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.common.messages import StepPlan
from pagedserve.worker.logits_processors import LogitsProcessors
from pagedserve.worker.sampler import MASK64, SamplerCopy, SamplingTensors
from pagedserve.worker.sequences import SeqState
from pagedserve.worker.spec.verify import SpecBatch


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    step_id: int
    seq_ids: list[int]  # the sequences that sample, in output order
    samplers: list[SeqState]
    tokens: torch.Tensor | None  # [S] the sampled tokens on the device (None when nothing samples)
    copy: SamplerCopy | None  # their way to the host
    started: torch.cuda.Event | None  # CUDA: brackets the step's GPU work
    ended: torch.cuda.Event | None
    previous_ended: torch.cuda.Event | None = None  # the end of the step before it on the GPU
    rows: dict[int, int] = field(default_factory=dict)  # seq id -> its row of `tokens`, filled when needed
    spec: SpecBatch | None = None  # its drafts, when sequences speculated (worker/spec/verify.py)

    def done(self) -> bool:
        return self.ended is None or self.ended.query()

    def row_of(self, seq_id: int) -> int:
        if not self.rows:
            first = self.spec.offsets.tolist() if self.spec is not None else range(len(self.seq_ids))
            self.rows = dict(zip(self.seq_ids, first, strict=True))  # (a drafting sequence is never fed)
        return self.rows[seq_id]


def step_sampling_tensors(
    samplers: list[SeqState], device: torch.device, processors: LogitsProcessors | None = None
) -> SamplingTensors:
    """The sampler's parameters of `samplers`, a column at a time (no object per row: it runs every step)."""
    n = len(samplers)
    position = np.fromiter((len(s.token_ids) + s.pending for s in samplers), np.int64, n)
    return SamplingTensors.from_params(
        [s.params for s in samplers],
        seed=np.fromiter((s.seed & MASK64 for s in samplers), np.uint64, n),
        position=position,
        device=device,
        processors=processors.prepare(samplers, position) if processors is not None else None,
    )


@dataclass
class ForwardedStep:
    """A step whose forward pass is queued and whose sampler is not yet (`ModelRunner.launch_forward`)."""

    plan: StepPlan
    seq_ids: list[int]  # the sequences that sample, in batch order (fork children join them)
    samplers: list[SeqState]
    logits: torch.Tensor  # [S, V] their rows
    started: torch.cuda.Event | None
    ended: torch.cuda.Event | None  # recorded once the sampler is queued
    spec: SpecBatch | None = None  # drafts verified in this step: `logits` holds 1 + d rows for those


def verifies_drafts(in_flight: Iterable[LaunchedStep]) -> bool:
    """Whether a step in flight verifies drafts. No plan may be launched behind it before it is finished: the
    drafts it accepts move its sequences' next positions and the spare slots it drops cut their block
    tables, which the next plan's inputs read. The scheduler plans nothing then (scheduler/speculation.py
    `blocks_planning`); a tensor-parallel follower, whose next plan comes while its step may still be in
    flight, finishes that step first (worker/server.py `_follow`)."""
    return any(step.spec is not None for step in in_flight)


def batch_indices(plan: StepPlan) -> list[int]:
    """The batch index of each of the plan's `sampling_seq_ids`: the logits rows the step keeps."""
    if plan.sampling_seq_ids == plan.scheduled_seq_ids:  # every scheduled sequence samples: most steps
        return list(range(len(plan.scheduled_seq_ids)))
    index = {seq_id: b for b, seq_id in enumerate(plan.scheduled_seq_ids)}
    return [index[seq_id] for seq_id in plan.sampling_seq_ids]
