"""Where a step's time goes between the scheduler, the worker's host code and the GPU (`--step-trace FILE`).

The worker (rank 0) writes one JSON line per step when it answers it, with its host timestamps in
milliseconds on one monotonic clock (`perf_counter`, from the worker's start):

- `recv`: the plan was read off the socket; `launched`: the step was queued on the device, its sampler
  included, which the worker queues after it answered the step before;
- `wait`: the worker started waiting for the step's results; `done`: they were in (the GPU finished it, if
  the worker had to wait); `sent`: its StepOutput went to the scheduler;
- `gpu_ms`, `idle_ms`: the step's GPU time and the GPU's idle time before it, from CUDA events (0 off CUDA);
- `seqs`, `tokens`, `decode` (every sequence computes one token of the plan), `drafts` (with speculation:
  the draft tokens verified beside them, absent when none);
- `phases`: how long each part of the launch took on the host (ms): `plan` (applying the plan's changes,
  the checks), `propose` (speculation: the proposer's drafts, a draft model's forwards included; ~0 without),
  `inputs` (the batch's arrays), `forward` (queuing the model, or replaying its graph; with drafts, the
  target's verification, as decode rows where they fit a graph: worker/spec/decode_rows.py),
  `previous_step` (waiting for the step before it and answering it), `sampling_params` and `sample`
  (queuing the sampler and the copy of its results);
- `split` (worker/launch_trace.py): on CUDA the step's GPU time cut at the end of its forward pass and at
  the start of its sampler (`forward_gpu_ms`, `sampler_wait_gpu_ms`: the GPU waiting for the sampler's
  launch, `sampler_gpu_ms`), and with structured output the masks' costs (`structured_rows`, `_wait_ms`:
  the launch waiting for the masks filled in the background, `_host_ms`, `_accept_ms`, `_fill_ms`,
  `_fill_threads`: the threads of the last accept-and-fill run, `_copy_ms`, `_reused_rows`: rows filled
  ahead of the plan, `_ahead`: 0 none, 1 behind the forward, 2 ahead of the plan);
- `ahead` (a draft model, a step with drafts; worker/spec/ahead.py): `ahead_ms`, the host time the draft
  model took drafting ahead, after the step before was answered and before this plan came (0 when none of
  its drafts was taken), `ahead_rows`, the rows whose drafts were made ahead, `plan_rows`, the rows
  proposed at the plan (inside the `propose` phase).

With async scheduling, plan N + 1 is made from step N - 1's answer, so `recv[N + 1] - sent[N - 1]` is the
scheduler's turnaround; the GPU idles before step N + 1 when that turnaround plus the worker's launch outlasts
step N. `summarize` reads a trace back into those numbers.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pagedserve.common.messages import StepOutput, StepPlan

# ModelRunner.launch_forward's and launch_sampling's, in order
PHASES = ("plan", "propose", "inputs", "forward", "previous_step", "sampling_params", "sample")
# worker/launch_trace.py's: the GPU split, then structured output's costs (worker/structured.py)
SPLIT_KEYS = (
    "forward_gpu_ms",
    "sampler_wait_gpu_ms",
    "sampler_gpu_ms",
    "structured_rows",
    "structured_reused_rows",
    "structured_wait_ms",
    "structured_host_ms",
    "structured_ahead_ms",
    "structured_accept_ms",
    "structured_fill_ms",
    "structured_fill_threads",
    "structured_copy_ms",
)


@dataclass
class _Open:
    seqs: int
    tokens: int
    decode: bool
    recv: float
    launched: float
    phases: dict[str, float]
    ahead: dict[str, float] = field(default_factory=dict)


@dataclass
class StepTrace:
    """Collects the timestamps of each step and writes its line once the step is answered."""

    path: Path
    _file: IO[str] | None = None
    _origin: float = field(default_factory=time.perf_counter)
    _open: dict[int, _Open] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", buffering=1 << 16)

    def _ms(self, t: float) -> float:
        return round((t - self._origin) * 1e3, 3)

    def launched(
        self, plan: StepPlan, received: float, launched: float, marks: dict[str, float] | None = None
    ) -> None:
        """`marks`: the host clock at the end of each phase of the launch, in order, from "start" (the
        runner's `launch_marks`); the trace keeps each phase's duration."""
        tokens = plan.num_scheduled_tokens
        decode = bool(tokens) and max(tokens) == 1
        times = list((marks or {}).items())
        phases = {name: round((t - before) * 1e3, 3) for (_, before), (name, t) in itertools.pairwise(times)}
        self._open[plan.step_id] = _Open(len(tokens), sum(tokens), decode, received, launched, phases)

    def drafted(self, step_id: int, stats: dict[str, float] | None) -> None:
        """After `launched`: how the step's drafts were made (worker/spec/ahead.py `DraftAhead.stats`)."""
        step = self._open.get(step_id)
        if step is not None and stats:
            step.ahead = dict(stats)

    def answered(
        self, out: StepOutput, wait: float, done: float, sent: float, split: dict[str, float] | None = None
    ) -> None:
        step = self._open.pop(out.step_id, None)
        if step is None or self._file is None:
            return
        line: dict[str, Any] = {
            "step": out.step_id,
            "seqs": step.seqs,
            "tokens": step.tokens,
            "decode": step.decode,
            "recv": self._ms(step.recv),
            "launched": self._ms(step.launched),
            "wait": self._ms(wait),
            "done": self._ms(done),
            "sent": self._ms(sent),
            "gpu_ms": round(out.gpu_time_s * 1e3, 3),
            "idle_ms": round(out.gpu_idle_before_s * 1e3, 3),
            "phases": step.phases,
        }
        if split:
            line["split"] = split
        if step.ahead:
            line["ahead"] = step.ahead
        drafts = sum(out.num_drafts)
        if drafts:  # speculation: the draft tokens the step verified (beside `tokens`, the plan's)
            line["drafts"] = drafts
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3)


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode steps' GPU and idle time, and what the idle time followed: for each decode step N + 1 with
    a step N before it, whether its plan reached the worker after step N had finished (`late_plans`: the
    scheduler's turnaround was the bottleneck) or before (the worker's own launch was), and the medians of
    the scheduler's turnaround (`recv[N + 1] - sent[N - 1]`) and of the worker's launch (`launched - recv`
    but the time it spent on the step before).
    """
    by_id = {s["step"]: s for s in steps}
    decode = [s for s in steps if s["decode"]]
    idle_late = idle_early = 0.0
    late = 0
    turnaround: list[float] = []
    for s in decode:
        before, two_before = by_id.get(s["step"] - 1), by_id.get(s["step"] - 2)
        if two_before is not None:
            turnaround.append(s["recv"] - two_before["sent"])
        if before is None:
            continue
        if s["recv"] > before["done"]:
            late += 1
            idle_late += s["idle_ms"]
        else:
            idle_early += s["idle_ms"]
    gpu = sum(s["gpu_ms"] for s in decode)
    idle = sum(s["idle_ms"] for s in decode)
    return {
        "decode_steps": len(decode),
        "decode_gpu_ms": round(gpu, 1),
        "decode_idle_ms": round(idle, 1),
        "decode_gpu_busy": round(gpu / (gpu + idle), 4) if gpu + idle else None,
        "gpu_ms_p50": _median([s["gpu_ms"] for s in decode]),
        "idle_ms_p50": _median([s["idle_ms"] for s in decode]),
        "idle_ms_p90": _p90([s["idle_ms"] for s in decode]),
        "late_plans": late,
        "idle_after_late_plans_ms": round(idle_late, 1),
        "idle_after_early_plans_ms": round(idle_early, 1),
        "scheduler_turnaround_ms_p50": _median(turnaround),
        "worker_launch_ms_p50": _median(
            [s["launched"] - s["recv"] - s["phases"].get("previous_step", 0.0) for s in decode]
        ),
        "worker_answer_ms_p50": _median([s["sent"] - s["done"] for s in decode]),
        **{
            f"{phase}_ms_p50": _median([s["phases"][phase] for s in decode if phase in s["phases"]])
            for phase in PHASES
        },
        **{
            f"{key}_p50": _median([s["split"][key] for s in decode if key in s.get("split", {})])
            for key in SPLIT_KEYS
        },
        "structured_ahead_steps": sum(1 for s in decode if s.get("split", {}).get("structured_ahead")),
        **_drafting_summary(steps),
    }


def _drafting_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps with drafts: how many took drafts made ahead, the host time drafting ahead took, and the
    rows drafted ahead and at the plan."""
    drafting = [s["ahead"] for s in steps if s.get("ahead")]
    taken = [a for a in drafting if a.get("ahead_rows")]
    return {
        "drafting_steps": len(drafting),
        "drafted_ahead_steps": len(taken),
        "drafted_ahead_ms_p50": _median([a["ahead_ms"] for a in taken]),
        "drafted_ahead_rows": sum(a.get("ahead_rows", 0) for a in drafting),
        "drafted_at_plan_rows": sum(a.get("plan_rows", 0) for a in drafting),
    }
