"""scripts/bench_codec.py times each per-step message it can round-trip, and writes the table as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench_codec import main


def test_bench_codec_prints_and_writes_every_message(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    rows = main(["--num-seqs", "8", "--json-out", str(out)])
    assert [row["message"] for row in rows] == [
        "StepPlan, 8 sequences",
        "StepOutput, 8 tokens",
        "StepOutput, 8 tokens + 5 logprobs",
    ]
    assert all(row["encode_us"] > 0 and row["decode_us"] > 0 and row["bytes"] > 0 for row in rows)
    assert json.loads(out.read_text()) == rows
