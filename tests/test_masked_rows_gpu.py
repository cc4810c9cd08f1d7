"""A row with no token left to draw on a GPU (worker/masked_rows.py): the Triton bitmask and processor
kernels, bfloat16 logits, CUDA graphs and the pipelined worker order; the clashing request fails alone with a
400 and its batch-mates complete. Skipped without CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import ErrorKind, SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.engine_loop import run_engine
from tests.test_masked_rows import LIMITS, SCHEMA, _letter_tokens, _schema_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _runner(model_dir, dtype: str) -> ModelRunner:
    config = WorkerConfig(model=str(model_dir), device="cuda", dtype=dtype, block_size=4, num_kv_blocks=200)
    return ModelRunner(config, attention_backend="triton")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_clashing_rules_fail_one_request_on_the_gpu(tiny_model_dir, dtype, pipelined):
    clash = _schema_params(allowed_token_ids=tuple(_letter_tokens(tiny_model_dir, 20)))
    banned = SamplingParams(
        max_tokens=8, temperature=0.0, allowed_token_ids=(40, 41), bad_words=((40,), (41,))
    )
    valid = _schema_params()
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    requests = [([5, 6, 7], clash), ([5, 6], banned), ([8, 9, 10, 11], valid), ([12, 13], plain)]
    run = run_engine(_runner(tiny_model_dir, dtype), requests, pipelined, **LIMITS)
    assert run.errors.keys() == {0, 1}
    assert all(e.kind == ErrorKind.INVALID_REQUEST for e in run.errors.values())
    # (batched differently, bfloat16 logits differ in their last bits: the batch-mates are checked for what
    # they must be, not against a run alone)
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(run.tokens[(2, 0)][:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert len(run.tokens[(3, 0)]) == 12
