"""scripts/bench_serving.py sends Poisson arrivals through the real api, scheduler and worker processes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from scripts.bench_serving import arrival_offsets, main, parse_rates, percentile

STATS = ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms")


def test_arrivals_are_a_poisson_process_of_the_rate_and_all_at_once_for_inf() -> None:
    assert arrival_offsets(5, math.inf, random.Random(0)) == [0.0] * 5
    offsets = arrival_offsets(4000, 8.0, random.Random(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps > 0).all()
    assert abs(gaps.mean() - 1 / 8) < 0.01 and abs(gaps.std() - 1 / 8) < 0.01  # exponential: std = mean
    assert arrival_offsets(50, 8.0, random.Random(3)) == arrival_offsets(50, 8.0, random.Random(3))


def test_percentile_interpolates_like_numpy() -> None:
    values = [random.Random(1).random() for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def test_rates_must_be_positive() -> None:
    assert parse_rates("1, 4,inf") == [1.0, 4.0, math.inf]
    for bad in ("0", "-1,2", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)


def _serve(model_dir: Path, tmp_path: Path, *options: str) -> dict:
    out = tmp_path / "serving.json"
    argv = ["--model", str(model_dir), "--device", "cpu", "--max-prompt-len", "64", "--num-kv-blocks", "128"]
    argv += ["--sample-interval", "0.02", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)]
    main([*argv, *options])
    return json.loads(out.read_text())


def _assert_every_request_whole(run: dict, wanted: list[int]) -> None:
    assert (run["completed"], run["errors"], run["num_requests"]) == (len(wanted), 0, len(wanted)), run
    assert [r["output_tokens"] for r in run["per_request"]] == wanted
    assert run["output_tokens"] == sum(wanted)
    for r in run["per_request"]:
        assert 0 < r["ttft_s"] <= r["latency_s"] and 1 <= r["num_chunks"] <= r["output_tokens"]
    for name in STATS:
        s = run[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
    assert run["ttft_ms"]["p99"] <= run["latency_ms"]["p99"]
    assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
    assert 1 <= run["peak_running"] <= len(wanted) and run["peak_kv_blocks_used"] >= 1


@pytest.mark.e2e
def test_bench_serving_streams_every_token_at_each_rate(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--num-requests", "8", "--rates", "4,inf", "--min-output-len", "8", "--max-output-len", "16"]
    report = _serve(tiny_model_dir, tmp_path, *options, "--logprobs", "on")

    assert report["benchmark"] == "serving" and report["engine"]["kv_blocks_total"] == 128
    assert report["workload"]["use_logprobs"] is True
    wanted = [r["output_len"] for r in report["requests"]]
    assert len(wanted) == 8 and all(8 <= n <= 16 for n in wanted) and len(set(wanted)) > 1
    assert [(r["rate"], r["request_rate"]) for r in report["runs"]] == [("4", 4.0), ("inf", None)]
    for run in report["runs"]:
        _assert_every_request_whole(run, wanted)
        # With logprobs, each step's token is a chunk of its own, text or not.
        assert [r["num_chunks"] for r in run["per_request"]] == wanted
        assert [r["streamed_tokens"] for r in run["per_request"]] == wanted
        assert run["cached_tokens"] == 0  # each rate has its own cache salt: no hits on the previous rate
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "inf" in printed

    pytest.importorskip("matplotlib")
    from scripts.plot_benchmarks import main as plot

    [chart] = plot([str(tmp_path / "serving.json"), "--out-dir", str(tmp_path / "charts")])
    assert chart.name == "serving.png" and chart.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.e2e
def test_bench_serving_counts_text_chunks_without_logprobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The tiny model's tokenizer covers its vocabulary, so auto leaves logprobs off.
    # Long enough outputs that the metrics sampler sees the requests running (4 tokens ran in 50 ms).
    options = ["--num-requests", "4", "--rates", "inf", "--min-output-len", "24", "--max-output-len", "48"]
    options += ["--num-warmup", "0"]
    report = _serve(tiny_model_dir, tmp_path, *options)

    assert report["workload"]["use_logprobs"] is False
    [run] = report["runs"]
    _assert_every_request_whole(run, [r["output_len"] for r in report["requests"]])
    assert all(r["streamed_tokens"] == 0 for r in run["per_request"])
