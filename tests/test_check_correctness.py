"""scripts/check_correctness.py: the engine's greedy tokens and logits against transformers (CPU, float32)."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.check_correctness import main


def test_float32_engine_is_identical_to_transformers_on_the_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "correctness.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "5", "--max-tokens", "12"]
    report = main([*argv, "--max-prompt-len", "40", "--json-out", str(out)])
    assert report == json.loads(out.read_text())
    assert report["dtype"] == "float32" and report["num_prompts"] == 5
    assert report["identical"] == 5 and report["divergences"] == []
    assert report["prompts"] == "random token ids"
    assert (
        report["transformers_dtype_identical_to_float32"]
        == report["engine_identical_to_transformers_float32"]
        == 5
    )
    assert report["max_logit_diff_engine_vs_float32"] < 1e-3  # float32 against float32: rounding only
