"""scripts/_bench.py: the table, the JSON record, the timing and the bracketed comparison every benchmark
script shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts._bench import (
    Bracketed,
    Timing,
    bracket_order,
    cell,
    format_table,
    run_record,
    time_repeats,
    write_json,
)


def test_table_right_aligns_every_column_under_its_header() -> None:
    table = format_table(["run", "tok/s"], [["paged", "12.5"], ["reserved-max", cell(None)]])
    assert table.splitlines() == [
        "         run  tok/s",
        "       paged   12.5",
        "reserved-max      -",
    ]
    assert cell(0.1234, ".2f") == "0.12" and cell(3) == "3"


def test_record_says_when_where_and_what_ran(tmp_path: Path) -> None:
    record = run_record("scripts/bench_throughput.py", ["--num-requests", "12", "--json-out", "a b.json"])
    assert set(record) == {"date", "gpu", "commit", "command"}
    # relative to the checkout, quoted for a shell
    assert record["command"] == "python scripts/bench_throughput.py --num-requests 12 --json-out 'a b.json'"
    assert record["date"].endswith("+00:00") and record["commit"]
    out = tmp_path / "deep" / "r.json"
    write_json(out, {"runs": [1], "record": record})
    assert json.loads(out.read_text()) == {"runs": [1], "record": record}
    write_json(out, [{"a": 1}])  # rows are written as they are
    assert json.loads(out.read_text()) == [{"a": 1}]
    write_json(None, {"nothing": "written"})


def test_timing_reports_the_median_and_the_spread_of_repeats() -> None:
    t = Timing((1.0, 3.0, 2.0, 2.0))
    assert (t.median, t.mean, t.spread) == (2.0, 2.0, 1.0)
    assert t.quantile(0.0) == 1.0 and t.quantile(1.0) == 3.0 and t.quantile(0.5) == 2.0
    calls = []
    timed = time_repeats(lambda: calls.append(1), repeat=5, number=3)
    assert len(calls) == 1 + 5 * 3  # one unmeasured call first
    assert len(timed.samples) == 5 and all(s >= 0 for s in timed.samples)


def test_bracketing_runs_the_baseline_around_every_candidate() -> None:
    assert bracket_order(1) == ["baseline", "candidate", "baseline"]
    assert bracket_order(2) == ["baseline", "candidate", "baseline", "candidate", "baseline"]
    runs = Bracketed(tuple(zip(bracket_order(2), [100.0, 110.0, 104.0, 112.0, 96.0], strict=True)))
    assert runs.of("baseline") == [100.0, 104.0, 96.0]
    assert runs.ratio == pytest.approx(111.0 / 100.0)
    assert runs.ratios() == pytest.approx([110.0 / 102.0, 112.0 / 100.0])
    assert runs.baseline_spread == pytest.approx(8.0 / 100.0)
    summary = runs.summary()
    assert summary["order"] == bracket_order(2) and summary["values"][1] == 110.0
    assert summary["ratio"] == 1.11 and summary["baseline_spread"] == 0.08
