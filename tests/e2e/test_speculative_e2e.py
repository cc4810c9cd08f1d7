"""Speculative decoding through the real api, scheduler and worker processes (pipelined as served): greedy and
seeded completions identical to a server without it, usage unchanged, the metrics counting drafts, and every
KV block free afterwards."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.processes import start_server

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def _complete(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def answers(tiny_model_dir, tmp_path_factory):
    motif = [17, 901, 33, 250, 7]
    bodies = [
        {"prompt": motif * 6, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
        {"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 20, "temperature": 0.0, "ignore_eos": True},
        {"prompt": motif * 4, "max_tokens": 16, "temperature": 0.6, "top_k": 4, "seed": 7, "n": 2,
         "ignore_eos": True, "logprobs": 1},
    ]  # fmt: skip
    out = {}
    for name, settings in (("off", {}), ("ngram", {"speculative_config": NGRAM})):
        server = start_server(
            tiny_model_dir, tmp_path_factory.mktemp(f"spec-{name}"), num_kv_blocks=64, **settings
        )
        try:
            out[name] = [_complete(server.url, {"model": "tiny-llama", **b}) for b in bodies]
            out[name + "_drafts"] = server.metric("pagedserve_spec_draft_tokens_total")
            server.wait_until_idle()
        finally:
            server.stop()
    return out


def test_completions_are_identical_with_and_without_speculation(answers):
    for plain, spec in zip(answers["off"], answers["ngram"], strict=True):
        assert [c["text"] for c in spec["choices"]] == [c["text"] for c in plain["choices"]]
        assert spec["usage"] == plain["usage"]
        for a, b in zip(plain["choices"], spec["choices"], strict=True):
            if a.get("logprobs"):
                assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
                assert b["logprobs"]["token_logprobs"] == pytest.approx(
                    a["logprobs"]["token_logprobs"], abs=1e-3
                )
    assert answers["ngram_drafts"] > 0 and answers["off_drafts"] == 0
