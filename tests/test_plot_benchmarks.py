"""scripts/plot_benchmarks.py turns the benchmark scripts' JSON into PNG charts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_serving import RequestTiming, summarize

pytest.importorskip("matplotlib")

from scripts.plot_benchmarks import kind_of, main  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _serving_report(scale: float) -> dict:
    rows = []
    for rate in (2.0, 8.0, float("inf")):
        timings = [
            RequestTiming(
                10, 4, ttft_s=scale * k * 0.01, latency_s=scale * k * 0.05, itls_s=[0.01] * 3, output_tokens=4
            )
            for k in range(1, 6)
        ]
        rows.append(summarize(rate, timings, duration_s=2.0))
    return {"benchmark": "serving", "runs": rows}


def test_plots_throughput_serving_and_sharing_json_as_png(tmp_path: Path) -> None:
    throughput = {
        "runs": [
            {"name": "paged", "output_tokens_per_s": 900.0},
            {"name": "reserved", "output_tokens_per_s": 700.0},
        ],
        "peers": [{"name": "hf-static", "output_tokens_per_s": 100.0}],
    }
    run = {"output_tokens_per_s": 50.0, "ttft_ms": {"p50": 3.0}, "peak_kv_blocks_used": 12}
    sharing = {"benchmark": "sharing", "runs": [run | {"name": "prefix-on"}, run | {"name": "prefix-off"}]}
    files = {"tp": throughput, "a": _serving_report(1.0), "b": _serving_report(2.0), "sh": sharing}
    for name, report in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(report))

    written = main([*(str(tmp_path / f"{n}.json") for n in files), "--out-dir", str(tmp_path / "charts")])

    assert sorted(p.name for p in written) == ["serving.png", "sharing.png", "throughput.png"]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def test_kind_of_refuses_json_of_something_else() -> None:
    assert kind_of({"runs": [{"output_tokens_per_s": 1.0}]}) == "throughput"
    assert kind_of({"benchmark": "serving", "runs": []}) == "serving"
    with pytest.raises(ValueError):
        kind_of({"hello": 1})


def test_a_run_repeated_in_one_file_gets_its_own_bar() -> None:
    from scripts.plot_benchmarks import _numbered

    runs = [{"name": "paged", "output_tokens_per_s": 2.0}, {"name": "sync", "output_tokens_per_s": 1.0}]
    runs += [{"name": "paged", "output_tokens_per_s": 3.0}, {"name": "paged", "output_tokens_per_s": 4.0}]
    assert _numbered(runs) == {"paged": 2.0, "sync": 1.0, "paged #2": 3.0, "paged #3": 4.0}


def test_a_peer_run_at_several_batch_sizes_is_named_by_its_batch_size() -> None:
    from scripts.plot_benchmarks import _numbered

    peers = [{"name": "hf-static", "batch_size": 32, "output_tokens_per_s": 5.0}]
    peers += [{"name": "hf-static", "batch_size": 128, "output_tokens_per_s": 6.0}]
    peers += [{"name": "hf-continuous", "batch_size": None, "output_tokens_per_s": 7.0}]
    want = {"hf-static (batch 32)": 5.0, "hf-static (batch 128)": 6.0, "hf-continuous": 7.0}
    assert _numbered(peers) == want


def _policy_run(policy: str, blocks: int, tok_s: float, **extra: object) -> dict:
    run = {"name": policy, "kv_policy": policy, "num_kv_blocks": blocks, "output_tokens_per_s": tok_s}
    return run | {"kv_cache_dtype": "auto"} | extra


def test_kv_budget_points_keep_the_policy_runs_by_model_and_budget() -> None:
    from scripts.plot_benchmarks import kv_budget_points

    small = {
        "model": "/tmp/m1b",
        "runs": [
            _policy_run("paged", 1024, 300.0),
            _policy_run("reserved-max", 1024, 100.0),
            _policy_run("paged", 1024, 500.0),  # a repeat: the median of 300, 500 and the other file's 340
            _policy_run("paged", 1024, 9e9, kv_cache_dtype="fp8"),  # another comparison
            {**_policy_run("paged", 1024, 9e9), "name": "paged-sync"},
            _policy_run("paged", 0, 9e9),  # the default pool: no budget of its own
        ],
    }
    large = {
        "model": "/tmp/m1b",
        "runs": [_policy_run("paged", 4096, 800.0), _policy_run("paged", 1024, 340.0)],
    }
    other = {"model": "/x/m8b", "runs": [_policy_run("reserved", 4096, 50.0)]}

    points = kv_budget_points([("a", small), ("b", large), ("c", other)])

    assert points == {
        ("m1b", "paged"): {1024: 340.0, 4096: 800.0},
        ("m1b", "reserved-max"): {1024: 100.0},
        ("m8b", "reserved"): {4096: 50.0},
    }


def test_kv_budget_chart_written_only_when_the_policy_runs_cover_two_budgets(tmp_path: Path) -> None:
    one = {"model": "m", "runs": [_policy_run("paged", 1024, 3.0), _policy_run("reserved", 1024, 1.0)]}
    two = {"model": "m", "runs": [_policy_run("paged", 2048, 5.0), _policy_run("reserved", 2048, 2.0)]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "two.json").write_text(json.dumps(two))

    alone = main([str(tmp_path / "one.json"), "--out-dir", str(tmp_path / "a")])
    both = main([str(tmp_path / "one.json"), str(tmp_path / "two.json"), "--out-dir", str(tmp_path / "b")])

    assert [p.name for p in alone] == ["throughput.png"]
    assert [p.name for p in both] == ["throughput.png", "kv_budget.png"]
    data = both[1].read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
