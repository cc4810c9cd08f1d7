"""scripts/bench_draft.py runs end to end on the CPU (numbers there mean nothing; the table and JSON do)."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench_draft import main
from scripts.make_model import make_model


def test_bench_draft_times_each_batch_and_writes_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    draft = make_model(tmp_path / "draft", preset="tiny-draft", seed=1)
    out = tmp_path / "draft.json"
    argv = ["--model", str(tiny_model_dir), "--draft", str(draft), "--device", "cpu", "--batches", "1,3"]
    results = main([*argv, "--context", "20", "--repeat", "2", "--number", "2", "--out", str(out)])
    assert [r["batch"] for r in results] == [1, 3]
    assert all(r["propose_ms"] > 0 and r["drafted_per_call"] == 4 for r in results)
    assert json.loads(out.read_text())["runs"] == results
    assert all(r["chained"] == 0 for r in results)  # the CPU has no graphs: the step-by-step path
    both = main([*argv, "--context", "20", "--repeat", "1", "--number", "2", "--chain", "both"])
    assert [r["batch"] for r in both] == [1, 1, 3, 3]
