"""worker/step_trace.py: the step trace's lines and what `summarize` reads from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.common.messages import StepOutput, StepPlan
from pagedserve.worker.step_trace import StepTrace, read_trace, summarize


def _step(step: int, recv: float, done: float, idle_ms: float, decode: bool = True) -> dict[str, object]:
    """A step answered 0.1 ms after it was done, launched 0.2 ms after its plan came, 4 ms on the GPU."""
    return {
        "step": step,
        "seqs": 8,
        "tokens": 8 if decode else 100,
        "decode": decode,
        "recv": recv,
        "launched": recv + 0.2,
        "wait": recv + 0.3,
        "done": done,
        "sent": done + 0.1,
        "gpu_ms": 4.0,
        "idle_ms": idle_ms,
        "phases": {"plan": 0.05, "inputs": 0.05, "forward": 0.1},
    }


def test_summarize_blames_idle_time_on_late_plans_or_on_the_worker() -> None:
    steps = [
        _step(0, recv=0.0, done=4.0, idle_ms=0.0, decode=False),
        _step(1, recv=1.0, done=8.0, idle_ms=0.0),  # came while step 0 ran
        _step(2, recv=9.0, done=13.5, idle_ms=1.5),  # came after step 1 was done (8.0): a late plan
        _step(3, recv=10.0, done=17.5, idle_ms=0.0),
        _step(4, recv=15.0, done=22.0, idle_ms=0.5),  # before step 3 was done, yet the GPU waited
    ]
    summary = summarize(steps)
    assert summary["decode_steps"] == 4
    assert summary["decode_gpu_ms"] == 16.0 and summary["decode_idle_ms"] == 2.0
    assert summary["decode_gpu_busy"] == pytest.approx(16 / 18, abs=1e-4)
    assert summary["late_plans"] == 1
    assert summary["idle_after_late_plans_ms"] == 1.5 and summary["idle_after_early_plans_ms"] == 0.5
    # turnarounds recv[N] - sent[N - 2]: 9.0 - 4.1, 10.0 - 8.1, 15.0 - 13.6
    assert summary["scheduler_turnaround_ms_p50"] == pytest.approx(1.9)
    assert summary["worker_launch_ms_p50"] == pytest.approx(0.2)
    assert summary["worker_answer_ms_p50"] == pytest.approx(0.1)
    assert summary["idle_ms_p50"] == pytest.approx(0.25) and summary["idle_ms_p90"] == 1.5
    assert (summary["plan_ms_p50"], summary["forward_ms_p50"], summary["sample_ms_p50"]) == (0.05, 0.1, None)


def test_the_trace_writes_a_line_per_answered_step(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path / "sub" / "steps.jsonl")
    plans = [
        StepPlan(
            7, [], [], [], scheduled_seq_ids=[1, 2], num_scheduled_tokens=[1, 1], sampling_seq_ids=[1, 2]
        ),
        StepPlan(
            8,
            [],
            [],
            [],
            scheduled_seq_ids=[1, 2, 3],
            num_scheduled_tokens=[1, 30, 1],
            sampling_seq_ids=[1, 3],
        ),
    ]
    t0 = trace._origin
    marks = {"start": t0, "plan": t0 + 0.0001, "inputs": t0 + 0.0003, "forward": t0 + 0.0006}
    for i, plan in enumerate(plans):
        trace.launched(plan, t0 + i, t0 + i + 0.001, marks)
    trace.answered(
        StepOutput(7, [1, 2], [5, 6], [None, None], 0.004, 0.0005),
        *(trace._origin + t for t in (1.5, 2, 2.5)),
    )
    trace.answered(StepOutput(99, [], [], []), trace._origin, trace._origin, trace._origin)  # never launched
    trace.close()
    (line,) = read_trace(tmp_path / "sub" / "steps.jsonl")  # step 8 was not answered yet
    assert line == {
        "step": 7,
        "seqs": 2,
        "tokens": 2,
        "decode": True,
        "recv": 0.0,
        "launched": 1.0,
        "wait": 1500.0,
        "done": 2000.0,
        "sent": 2500.0,
        "gpu_ms": 4.0,
        "idle_ms": 0.5,
        "phases": {"plan": 0.1, "inputs": 0.2, "forward": 0.3},
    }


def test_summarize_reports_the_sampler_wait_and_the_masks_costs() -> None:
    """The split of each decode step (worker/launch_trace.py) is summarized as medians; steps without it
    (a plain workload off CUDA) give None, and the steps whose masks filled ahead of the plan are counted."""
    steps = [_step(k, recv=5.0 * k, done=5.0 * k + 4, idle_ms=0.0) for k in range(4)]
    for k, s in enumerate(steps[:3]):
        s["split"] = {
            "forward_gpu_ms": 3.0,
            "sampler_wait_gpu_ms": float(k),  # 0, 1, 2
            "sampler_gpu_ms": 1.0,
            "structured_rows": 900,
            "structured_wait_ms": 2.0 + k,
            "structured_fill_ms": 0.5,
            "structured_ahead": 2 if k else 1,
        }
    summary = summarize(steps)
    assert summary["sampler_wait_gpu_ms_p50"] == 1.0 and summary["forward_gpu_ms_p50"] == 3.0
    assert summary["structured_rows_p50"] == 900 and summary["structured_wait_ms_p50"] == 3.0
    assert summary["structured_ahead_steps"] == 3 and summary["structured_copy_ms_p50"] is None
    plain = summarize([_step(k, recv=5.0 * k, done=5.0 * k + 4, idle_ms=0.0) for k in range(4)])
    assert plain["sampler_wait_gpu_ms_p50"] is None and plain["structured_ahead_steps"] == 0


def test_the_trace_line_carries_the_split(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path / "steps.jsonl")
    plan = StepPlan(3, [], [], [], scheduled_seq_ids=[1], num_scheduled_tokens=[1], sampling_seq_ids=[1])
    trace.launched(plan, trace._origin, trace._origin)
    split = {"sampler_wait_gpu_ms": 0.25, "structured_rows": 1}
    trace.answered(StepOutput(3, [1], [5], [None]), *(trace._origin,) * 3, split)
    trace.close()
    (line,) = read_trace(tmp_path / "steps.jsonl")
    assert line["split"] == split


def test_the_trace_says_how_a_steps_drafts_were_made(tmp_path: Path) -> None:
    """A step whose drafts were made ahead of its plan (worker/spec/ahead.py) carries `ahead`; one without
    drafts, nothing; `summarize` counts the steps that took drafts made ahead and their host time."""
    trace = StepTrace(tmp_path / "steps.jsonl")
    stats = [
        {"ahead_ms": 2.0, "ahead_rows": 1, "plan_rows": 0},
        {},
        {"ahead_ms": 0.0, "ahead_rows": 0, "plan_rows": 2},
    ]
    for step, s in enumerate(stats):
        plan = StepPlan(
            step, [], [], [], scheduled_seq_ids=[1], num_scheduled_tokens=[1], sampling_seq_ids=[1]
        )
        trace.launched(plan, trace._origin, trace._origin)
        trace.drafted(step, s)
        trace.answered(StepOutput(step, [1], [5], [None]), *(trace._origin,) * 3)
    trace.drafted(9, stats[0])  # a step not launched: nothing
    trace.close()
    lines = read_trace(tmp_path / "steps.jsonl")
    assert [line.get("ahead") for line in lines] == [stats[0], None, stats[2]]
    summary = summarize(lines)
    assert summary["drafting_steps"] == 2 and summary["drafted_ahead_steps"] == 1
    assert summary["drafted_ahead_ms_p50"] == 2.0
    assert (summary["drafted_ahead_rows"], summary["drafted_at_plan_rows"]) == (1, 2)
    plain = summarize([_step(k, recv=5.0 * k, done=5.0 * k + 4, idle_ms=0.0) for k in range(2)])
    assert plain["drafting_steps"] == 0 and plain["drafted_ahead_ms_p50"] is None
