"""scripts/bench_kv_tiers.py runs multi-turn conversations past a small pool, with and without the host tier,
through the real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_kv_tiers import main


@pytest.mark.e2e
def test_bench_kv_tiers_runs_every_turn_and_the_host_tier_serves_returning_histories(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiers.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "8", "--max-num-seqs", "4"]
    argv += ["--conversations", "4", "--turns", "3", "--system-len", "48", "--user-len", "8"]
    argv += ["--output-len", "4", "--concurrency", "2", "--configs", "off,host", "--kv-offload-gb", "0.01"]
    main([*argv, "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)])
    report = json.loads(out.read_text())
    off, host = report["runs"]
    assert report["benchmark"] == "kv_tiers" and (off["config"], host["config"]) == ("off", "host")
    for run in (off, host):
        assert (run["turns"], run["errors"]) == (12, 0), run["error_examples"]
        assert 0 < run["ttft_ms_returning"]["p50"] <= run["ttft_ms_returning"]["p99"]
    assert off["counters"]["kv_host_tier_hits_total"] == 0
    assert host["counters"]["kv_host_tier_hits_total"] > 0
    assert host["cached_share_returning"] > off["cached_share_returning"] + 0.3
    assert host["answers_digest"] == off["answers_digest"]  # the same greedy tokens, every turn
    assert "host" in capsys.readouterr().out
