"""The host KV tier through the real processes, as served by default (--kv-offload-gb -1): conversations
cycled past a 16-block GPU pool come back to find their history in host memory, and say so in
`usage.prompt_tokens_details.cached_tokens` and in /metrics; every answer is transformers' greedy one."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.e2e.processes import start_server
from tests.test_engine_correctness import transformers_generate

pytestmark = pytest.mark.e2e
BS = 16
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        num_kv_blocks=16,
        block_size=BS,
        max_num_seqs=4,
        max_model_len=256,
    )
    yield srv
    srv.stop()


@pytest.fixture
def one_thread():
    """transformers' reference on the tiny model: one thread (two only wait for each other when loaded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_returning_conversations_hit_the_host_tier(server, tiny_model_dir, one_thread):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(5)
    history = {c: [rng.randrange(model.config.vocab_size) for _ in range(40)] for c in range(8)}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for turn in range(3):
            for c in range(8):  # 8 x 50-70 tokens pass through a pool of 256 between two turns of one
                prompt = history[c] + [rng.randrange(model.config.vocab_size) for _ in range(8)]
                body = {
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                }
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                named = r.json()["choices"][0]["logprobs"]["tokens"]
                answer = [int(t.removeprefix("token_id:")) for t in named]
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                (expected,) = transformers_generate(model, [prompt], MAX_TOKENS)
                assert answer == expected, f"conversation {c}, turn {turn}"
                if turn > 0:  # its history but the block its answer was still filling
                    assert cached >= (len(history[c]) - 1) // BS * BS - BS, f"conversation {c}, turn {turn}"
                history[c] = prompt + expected
    assert server.metric("pagedserve_kv_host_tier_hits_total") > 0
    assert server.metric("pagedserve_kv_host_tier_stores_total") > 0
    assert server.metric("pagedserve_kv_host_tier_capacity_blocks") > 0
    # a block: K and V x 4 layers x 16 tokens x 2 heads x 32 x 4 bytes
    blocks = server.metric("pagedserve_kv_host_tier_blocks")
    assert blocks > 0 and server.metric("pagedserve_kv_host_tier_bytes") == blocks * 2 * 4 * BS * 2 * 32 * 4
