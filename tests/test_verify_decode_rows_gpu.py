"""Verification as decode rows on a GPU (worker/spec/decode_rows.py): the target's verification replays its
decode CUDA graphs (Triton kernels), and greedy outputs with speculation stay those without; past the
largest graph it falls back to the mixed path (skipped without CUDA; `pytest -m gpu` on the device)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.test_speculative_engine import NGRAM, prompts, run_engine
from tests.test_verify_decode_rows import decode_row_steps  # noqa: F401 (the fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _runner(model_dir, speculative: str = "", max_num_seqs: int = 16) -> ModelRunner:
    config = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
        max_num_seqs=max_num_seqs, max_model_len=512, swap_space=0, speculative_config=speculative,
    )  # fmt: skip
    return ModelRunner(config, attention_backend="triton")


def _self_draft(model_dir) -> str:
    return json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    runner = _runner(tiny_model_dir)
    out = run_engine(runner, prompts(runner.vocab_size), GREEDY, pipelined=True, max_num_seqs=16)[0]
    runner.close()
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_replays_the_decode_graphs(
    tiny_model_dir,
    plain,
    decode_row_steps,  # noqa: F811 (the fixture, imported)
    method,
):
    spec = NGRAM
    if method == "draft_model":  # the target as its own draft: every draft accepted, 5 rows a sequence
        spec = json.dumps(
            {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4}
        )
    runner = _runner(tiny_model_dir, spec)
    assert runner.graphs is not None and runner.mixed_graphs is not None
    replays = runner.graphs.num_replays
    ours, scheduler, _ = run_engine(runner, prompts(runner.vocab_size), GREEDY, False, max_num_seqs=16)
    assert ours == plain
    assert scheduler.metrics.spec_accepted_tokens_total > 0
    assert decode_row_steps and all(runner.graphs.padded_size(rows) for _, rows in decode_row_steps)
    assert runner.graphs.num_replays - replays >= len(decode_row_steps)
    runner.close()


def test_rows_past_the_largest_graph_verify_on_the_mixed_path(
    tiny_model_dir,
    plain,
    decode_row_steps,  # noqa: F811 (the fixture, imported)
):
    runner = _runner(
        tiny_model_dir, _self_draft(tiny_model_dir), max_num_seqs=4
    )  # 4 sequences of 5 rows: past the graph of 4
    assert runner.graphs is not None and runner.graphs.padded_size(5) is None
    ours, _, _ = run_engine(runner, prompts(runner.vocab_size), GREEDY, False, max_num_seqs=4)
    assert ours == plain
    assert all(rows <= 4 for _, rows in decode_row_steps)
    runner.close()
