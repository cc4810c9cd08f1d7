"""The ZeroMQ client library against the real scheduler and worker: batches, streams, errors, aborts."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.client import EngineClient, RequestRejected
from pagedserve.common.messages import SamplingParams

pytestmark = pytest.mark.e2e


def test_batch_of_text_and_token_prompts_streams_and_finishes(server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with EngineClient(server.scheduler_address) as client:
        prompts = ["Hello there", [3, 4, 5, 6], "naïve café 日本語 🙂"] * 8
        results = client.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        assert len(results) == 24
        for i, result in enumerate(results):
            out = result.outputs[0]
            assert len(out.token_ids) == 10 and out.finish_reason == "length"
            assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
            assert out.token_ids == results[i % 3].outputs[0].token_ids  # greedy: same prompt, same tokens
        assert results[1].prompt_token_ids == [3, 4, 5, 6]

        handle = client.submit(["Count with me"], SamplingParams(max_tokens=6, n=2, seed=3))[0]
        deltas = list(handle)
        assert {d.index for d in deltas} == {0, 1}
        assert sum(len(d.token_ids) for d in deltas) <= 12
        assert all(d.finish_reason in (None, "stop", "length") for d in deltas)


def test_scheduler_refusals_are_typed_errors(server):
    with EngineClient(server.scheduler_address) as client:
        handle = client.submit([[1, 2, 10**8]], SamplingParams(max_tokens=2))[0]
        with pytest.raises(RequestRejected) as info:
            handle.result(timeout=30)
        assert info.value.kind == "invalid_request_error" and "vocabulary" in info.value.message
        handle = client.submit([[1] * 500], SamplingParams(max_tokens=100))[0]
        with pytest.raises(RequestRejected, match="maximum context length"):
            handle.result(timeout=30)
        # still serving
        assert client.generate([[1, 2]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_abort_ends_the_request_and_frees_its_blocks(server):
    with EngineClient(server.scheduler_address) as client:
        handle = client.submit([[7] * 40], SamplingParams(max_tokens=400, ignore_eos=True))[0]
        first = next(iter(handle))
        assert first.token_ids
        handle.abort()
        result = handle.result(timeout=30)
        assert result.outputs[0].finish_reason == "abort"
        assert len(result.outputs[0].token_ids) < 400
    server.wait_until_idle()
