"""scripts/bench_sharing.py measures prefix caching and parallel sampling through real engine processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_sharing import main, parallel_jobs, parse_args, prefix_jobs


def test_workloads_share_one_system_prompt_and_the_parallel_prompts() -> None:
    args = parse_args(["--prefix-requests", "5", "--prefix-len", "40", "--parallel-prompts", "3"])
    jobs = prefix_jobs(args, vocab_size=1000)
    assert len({tuple(j.prompt_token_ids[:40]) for j in jobs}) == 1
    assert len({tuple(j.prompt_token_ids[40:]) for j in jobs}) == 5
    assert all(16 <= len(j.prompt_token_ids) - 40 <= 64 for j in jobs)
    runs = parallel_jobs(args, vocab_size=1000)
    together, apart = runs["parallel-n4"], runs["independent"]
    assert [j.params.n for j in together] == [4] * 3 and [j.params.n for j in apart] == [1] * 12
    assert [j.prompt_token_ids for j in apart] == [j.prompt_token_ids for j in together for _ in range(4)]
    assert len({j.params.seed for j in apart}) == 12 and all(j.params.temperature > 0 for j in apart)


def _run(model_dir: Path, tmp_path: Path, part: str, *options: str) -> dict[str, dict]:
    out = tmp_path / f"{part}.json"
    argv = ["--model", str(model_dir), "--device", "cpu", "--num-kv-blocks", "256", "--parts", part]
    argv += ["--sample-interval", "0.01", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)]
    main([*argv, *options])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "sharing" and report["kv_blocks_total"] == 256
    return {r["name"]: r for r in report["runs"]}


@pytest.mark.e2e
def test_bench_sharing_prefix_caching_serves_the_system_prompt_from_cache(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--prefix-requests", "8", "--prefix-len", "128", "--prefix-output-len", "8"]
    # A step budget below two prompts: later requests arrive after the prefix is computed and cached.
    runs = _run(tiny_model_dir, tmp_path, "prefix", *options, "--max-num-batched-tokens", "256")

    assert list(runs) == ["prefix-on", "prefix-off"]
    on, off = runs["prefix-on"], runs["prefix-off"]
    for run in (on, off):
        assert run["completed"] == run["num_requests"] == run["num_sequences"] == 8
        assert run["output_tokens"] == 8 * 8
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["latency_ms"]["p99"]
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["prefix_cache_hits"] > 0 and on["cached_tokens"] > 0 and on["peak_kv_blocks_saved"] > 0
    assert on["cached_tokens"] % 16 == 0  # whole blocks of the shared prompt
    assert off["prefix_cache_hits"] == off["cached_tokens"] == 0
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] == off["prompt_tokens"]
    assert "computed prompt tok" in capsys.readouterr().out


@pytest.mark.e2e
def test_bench_sharing_parallel_samples_hold_fewer_blocks_than_independent_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    options = ["--parallel-prompts", "2", "--parallel-prompt-len", "100", "--parallel-output-len", "32"]
    runs = _run(tiny_model_dir, tmp_path, "parallel", *options)

    together, apart = runs["parallel-n4"], runs["independent"]
    assert (together["num_requests"], apart["num_requests"]) == (2, 8)
    for run in (together, apart):
        assert run["num_sequences"] == 8 and run["output_tokens"] == 8 * 32
        assert run["prefix_caching"] is False and run["cached_tokens"] == 0
        assert run["peak_kv_blocks_used"] > 0 and run["num_samples"] > 1
    # At the end: forks share the prompt's 6 full blocks, 2 * (6 + 4 * 3) = 36, against 8 * 9 = 72 blocks.
    assert together["peak_kv_blocks_used"] < apart["peak_kv_blocks_used"]
    assert together["peak_kv_blocks_saved"] > 0 and apart["peak_kv_blocks_saved"] == 0

    pytest.importorskip("matplotlib")
    from scripts.plot_benchmarks import main as plot

    [chart] = plot([str(tmp_path / "parallel.json"), "--out-dir", str(tmp_path / "charts")])
    assert chart.name == "sharing.png" and chart.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
