"""scripts/bench_structured.py --worker-path runs the worker's own per-step call (a smoke test: no timing
is asserted)."""

from __future__ import annotations

from scripts.bench_structured import bench_worker_path


def test_worker_path_runs_the_worker_call(tiny_model_dir):
    row = bench_worker_path("pagedserve.worker.structured", str(tiny_model_dir), batch=8, steps=3, threads=2)
    assert set(row) == {"median_ms", "p90_ms", "cpu_median_ms", "finished"}
    assert row["median_ms"] > 0 and 0 <= row["finished"] <= 1


def test_worker_path_staggered_and_profiled(tiny_model_dir):
    row = bench_worker_path(
        "pagedserve.worker.structured",
        str(tiny_model_dir),
        batch=6,
        steps=3,
        threads=1,
        stagger=5,
        profile=True,
    )
    assert row["accept_ms"] > 0 and row["fill_ms"] > 0
