"""scripts/bench_throughput.py runs the offline workload through real scheduler + worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_throughput import main, parse_args, parse_side


@pytest.mark.e2e
def test_bench_throughput_compares_paged_reserved_and_sync_scheduling_at_one_kv_budget(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-requests", "12"]
    argv += ["--max-prompt-len", "48", "--max-output-len", "16", "--num-kv-blocks", "24"]
    argv += ["--max-model-len", "128", "--runs", "paged,reserved,paged-sync,reserved-max"]
    argv += ["--sample-interval", "0.02", "--step-trace"]
    argv += ["--log-dir", str(tmp_path / "logs")]
    main([*argv, "--json-out", str(out)])

    report = json.loads(out.read_text())
    wanted = [r["output_len"] for r in report["requests"]]
    assert len(wanted) == 12 and all(16 == n for n in wanted)
    paged, reserved, sync, reserved_max = report["runs"]
    policies = [run["kv_policy"] for run in report["runs"]]
    assert policies == ["paged", "reserved", "paged", "reserved-max"]
    assert (paged["async_scheduling"], sync["async_scheduling"]) == (True, False)
    assert all(run["fused_ops"] == "default" for run in report["runs"])  # the CPU's default: PyTorch ops
    for run in report["runs"]:
        assert run["completed"] == run["num_requests"] == 12
        assert run["output_lens"] == wanted and run["output_tokens"] == sum(wanted)
        assert run["num_kv_blocks"] == 24 and run["max_model_len"] == 128
        assert run["output_tokens_per_s"] > 0 and run["total_tokens_per_s"] > 0 and run["requests_per_s"] > 0
        assert isinstance(run["preemptions"], int) and run["preemptions"] >= 0
        assert 1 <= run["peak_running"] <= 12
        # every request takes 16 steps; the first step prefills, so not every step is decode-only
        assert 16 <= run["steps"] and 0 < run["decode_steps"] < run["steps"]
        # the worker's step trace, past the warm-up's steps, saw the same decode-only steps
        trace = run["step_trace"]
        assert trace["decode_steps"] == run["decode_steps"]
        assert trace["decode_gpu_ms"] == trace["decode_idle_ms"] == 0  # no CUDA events on the CPU
        assert trace["worker_launch_ms_p50"] > 0 and trace["scheduler_turnaround_ms_p50"] > 0
        steps = [json.loads(line) for line in (tmp_path / "logs" / run["name"] / "steps.jsonl").open()]
        assert len(steps) > run["steps"]  # the warm-up's steps first
        assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # answered in order, once
        assert all(s["recv"] <= s["launched"] <= s["wait"] <= s["done"] <= s["sent"] for s in steps)
    assert paged["mean_kv_waste"] < reserved["mean_kv_waste"] < reserved_max["mean_kv_waste"]
    assert reserved_max["peak_running"] <= 3  # 128 tokens = 8 of the 24 blocks claimed per request
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and "reserved" in printed


@pytest.mark.e2e
def test_bench_throughput_runs_both_transformers_peers_on_the_cpu(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-requests", "6", "--num-warmup", "2"]
    argv += ["--min-prompt-len", "4", "--max-prompt-len", "24"]
    argv += ["--min-output-len", "4", "--max-output-len", "12"]
    argv += ["--num-kv-blocks", "32", "--peers", "hf-static,hf-continuous", "--peer-requests", "4"]
    argv += ["--peer-batch-size", "2,4", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)]
    main(argv)

    report = json.loads(out.read_text())
    wanted = [r["output_len"] for r in report["requests"]][:4]
    assert len(set(wanted)) > 1  # uneven lengths: static batching pads, continuous batching must not
    static2, static4, continuous = report["peers"]
    names = [(p["name"], p["batch_size"]) for p in report["peers"]]
    assert names == [("hf-static", 2), ("hf-static", 4), ("hf-continuous", None)]
    for peer in (static2, static4, continuous):
        assert peer["num_requests"] == peer["completed"] == 4 and peer["wrong_lengths"] == 0
        assert peer["output_tokens"] == sum(wanted) and peer["output_tokens_per_s"] > 0
    assert continuous["generated_tokens"] == sum(wanted)  # each request exactly its own length
    # padded to each batch's longest: two batches of 2, then one batch of 4
    assert static2["generated_tokens"] == 2 * max(wanted[:2]) + 2 * max(wanted[2:])
    assert static4["generated_tokens"] == 4 * max(wanted)


def test_compare_sides_are_key_value_settings() -> None:
    assert parse_side("kv_cache_dtype=fp8,num_kv_blocks=16384") == {
        "kv_cache_dtype": "fp8",
        "num_kv_blocks": 16384,
    }
    assert parse_side("") == {}
    with pytest.raises(ValueError):
        parse_side("block_size=32")
    with pytest.raises(SystemExit):
        parse_args(["--compare", "run=paged", "run=nonsense"])
    with pytest.raises(SystemExit):
        parse_args(["--runs", "paged,reserved", "--compare", "", "run=paged-sync"])


@pytest.mark.e2e
def test_compare_brackets_the_candidate_between_baseline_runs_in_one_call(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-requests", "6", "--num-warmup", "2"]
    argv += [
        "--min-prompt-len",
        "4",
        "--max-prompt-len",
        "24",
        "--min-output-len",
        "4",
        "--max-output-len",
        "8",
    ]
    argv += ["--sample-interval", "0.05", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)]
    # The candidate runs the same code from an explicitly named checkout (this one), with another KV pool.
    tree = Path(__file__).resolve().parents[1]
    argv += ["--compare", "num_kv_blocks=24", f"num_kv_blocks=32,tree={tree}"]
    report = main(argv)

    assert json.loads(out.read_text()) == report
    assert report["record"]["command"].startswith("python scripts/bench_throughput.py --model")
    runs = report["runs"]
    assert [r["role"] for r in runs] == ["baseline", "candidate", "baseline"]
    assert [r["num_kv_blocks"] for r in runs] == [24, 32, 24]
    assert all(r["name"] == "paged" and r["completed"] == 6 for r in runs)
    assert runs[0]["commit"] == runs[1]["commit"] == report["record"]["commit"]  # the same checkout
    comparison = report["comparison"]
    assert (comparison["baseline"], comparison["candidate"]) == (
        "num_kv_blocks=24",
        f"num_kv_blocks=32,tree={tree}",
    )
    out_tok = comparison["output_tokens_per_s"]
    assert out_tok["values"] == [r["output_tokens_per_s"] for r in runs]
    mean_base = (runs[0]["output_tokens_per_s"] + runs[2]["output_tokens_per_s"]) / 2
    assert out_tok["ratio"] == pytest.approx(runs[1]["output_tokens_per_s"] / mean_base, abs=1e-4)
    assert out_tok["bracket_ratios"] == [out_tok["ratio"]] and out_tok["baseline_spread"] >= 0
    printed = capsys.readouterr().out
    assert "baseline before" in printed and "baseline after" in printed and "spread" in printed
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "0-baseline",
        "1-candidate",
        "2-baseline",
    ]


@pytest.mark.e2e
def test_bench_throughput_json_schema_constrains_every_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--json-schema`: the same workload, every output following the schema up to its end (then EOS, so
    the lengths are the plain workload's); the row records the schema, and `--step-trace` the masks' costs."""
    schema = Path(__file__).resolve().parents[1] / "scripts" / "bench_schema.json"
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-requests", "6", "--num-warmup", "1"]
    argv += ["--max-prompt-len", "32", "--max-output-len", "24", "--num-kv-blocks", "32"]
    argv += ["--max-model-len", "128", "--log-dir", str(tmp_path / "logs"), "--json-schema", str(schema)]
    main([*argv, "--step-trace", "--json-out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["json_schema"] == str(schema) and run["completed"] == 6
    # the worker's trace carries the masks' costs of each step (worker/launch_trace.py); no GPU split here
    trace = run["step_trace"]
    assert trace["structured_rows_p50"] >= 1 and trace["structured_fill_ms_p50"] >= 0
    assert trace["structured_wait_ms_p50"] is not None and trace["sampler_wait_gpu_ms_p50"] is None
    assert parse_side("json_schema=") == {"json_schema": ""}
