"""scripts/bench_speculative.py: TPOT with and without speculation through the real processes."""

from __future__ import annotations

import json

import pytest

from scripts.bench_speculative import main, parse_args, spec_delta


def test_flags_are_checked() -> None:
    args = parse_args(["--configs", "off", '{"num_speculative_tokens": 2}', "--concurrency", "1,4"])
    assert args.concurrency == [1, 4]
    for bad in (["--configs", '{"num_speculative_tokens": 2, "bogus": 1}'], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_acceptance_comes_from_the_metrics_delta() -> None:
    before = {"pagedserve_spec_draft_tokens_total": 10, "pagedserve_spec_accepted_tokens_total": 4}
    after = {
        "pagedserve_spec_draft_tokens_total": 30,
        "pagedserve_spec_accepted_tokens_total": 14,
        "pagedserve_spec_acceptance_length_count": 8,
    }
    d = spec_delta(before, after)
    assert d["draft_tokens"] == 20 and d["accepted_tokens"] == 10
    assert d["mean_accepted"] == 10 / 8 and d["acceptance_rate"] == 0.5
    assert spec_delta({}, {})["mean_accepted"] is None


def test_a_cpu_run_with_and_without_ngram(tiny_model_dir, tmp_path) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 3}'
    report = main(
        [
            "--model", str(tiny_model_dir), "--device", "cpu", "--configs", "off", config,
            "--concurrency", "1,2", "--requests-per-stream", "1", "--output-len", "6",
            "--min-prompt-len", "8", "--max-prompt-len", "16", "--json-out", str(tmp_path / "spec.json"),
        ]
    )  # fmt: skip
    rows = report["runs"]
    assert [(r["config"], r["concurrency"]) for r in rows] == [
        ("off", 1),
        ("off", 2),
        (config, 1),
        (config, 2),
    ]
    assert all(r["completed"] == r["concurrency"] and not r["errors"] for r in rows)
    assert all(r["tpot_ms"]["p50"] > 0 for r in rows)
    assert all(r["draft_tokens"] == 0 for r in rows[:2])
    assert (tmp_path / "spec.json").exists()


def test_a_cpu_run_with_a_draft_model_drafting_ahead_and_not(tiny_model_dir, tmp_path) -> None:
    """Through the real processes (the worker's own loop): the target as its own draft, with and without
    drafting ahead; the step traces say which steps took drafts made ahead (worker/spec/ahead.py)."""
    config = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3})
    report = main(
        [
            "--model", str(tiny_model_dir), "--device", "cpu", "--configs", config, "--draft-ahead", "both",
            "--concurrency", "1", "--requests-per-stream", "2", "--output-len", "24",
            "--min-prompt-len", "8", "--max-prompt-len", "16", "--step-trace", str(tmp_path / "trace"),
        ]
    )  # fmt: skip
    rows = report["runs"]
    label = f"{config} (no draft ahead)"
    assert [r["config"] for r in rows] == [config, label]
    assert all(r["completed"] == 2 and not r["errors"] for r in rows)
    assert all(r["accepted_tokens"] == r["draft_tokens"] > 0 for r in rows)  # the target drafts itself
    ahead, plain = report["step_traces"][config], report["step_traces"][label]
    assert ahead["drafting_steps"] > 0 and plain["drafting_steps"] > 0
    assert ahead["drafted_ahead_steps"] > 0 and ahead["drafted_ahead_ms_p50"] > 0
    assert plain["drafted_ahead_steps"] == 0 and plain["drafted_ahead_rows"] == 0
    assert plain["drafted_at_plan_rows"] > 0
