"""scripts/submit_batch.py runs a batch through the ZeroMQ client and reports what came back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.submit_batch import main
from tests.api.fake_scheduler import FakeScheduler
from tests.api.harness import BackgroundLoop


def test_submit_batch_reports_throughput_and_outputs(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    background = BackgroundLoop()
    fake = background.run(FakeScheduler(model_root=str(tiny_model_dir)).start())
    try:
        out = tmp_path / "stats.json"
        argv = ["--address", fake.address, "--num-prompts", "20", "--prompt-len", "8", "--max-tokens", "5"]
        main([*argv, "--n", "2", "--show", "1", "--json-out", str(out)])
        main(
            [
                "--address",
                fake.address,
                "--text",
                "Once upon a time",
                "--num-prompts",
                "2",
                "--max-tokens",
                "4",
            ]
        )
    finally:
        background.run(fake.stop())
        background.close()
    stats = json.loads(out.read_text())
    assert stats["num_requests"] == 20 and stats["output_tokens"] == 20 * 2 * 5
    assert stats["prompt_tokens"] == 160 and stats["output_tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "requests_per_s" in printed and "#1 length]" in printed
    assert "] 'Once" in printed  # text prompts come back as text (the fake echoes the prompt)
    submits = fake.submits()
    assert [len(s.prompt_token_ids) for s in submits[:20]] == [8] * 20 and submits[0].params.n == 2
