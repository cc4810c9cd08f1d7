"""Prompt scoring over HTTP through the real api, scheduler and CPU worker: completions `echo` with `logprobs`
(lm-eval-harness's loglikelihood request: `echo: true, logprobs: k, max_tokens: 0`) and vLLM's
`prompt_logprobs`, against transformers' own model's log-softmax of the same prompt (float32, 1e-4)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.e2e.processes import start_server

pytestmark = pytest.mark.e2e

CHUNK = 32  # the server's prefill chunk: max_num_batched_tokens


@pytest.fixture(scope="module")
def real_server(tiny_model_dir, tmp_path_factory):
    srv = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=CHUNK,
        max_model_len=256,
        dtype="float32",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _post(server, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_scores(model, ids: list[int], token_logprobs: list, top_logprobs: list | None, k: int) -> None:
    """token_logprobs[t] is prompt token t's logprob (None for t = 0); top_logprobs[t] holds k entries."""
    ref = _reference(model, ids)
    assert token_logprobs[0] is None
    expected = [ref[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    if top_logprobs is not None:
        assert top_logprobs[0] is None
        for t in range(1, len(ids)):
            best = ref[t - 1].topk(k).values.tolist()
            # keyed by token text: two tokens sharing a text keep the first (the better) of them
            assert max(top_logprobs[t].values()) == pytest.approx(best[0], abs=1e-4)
            assert len(top_logprobs[t]) <= k


def test_lm_eval_loglikelihood_request_through_the_openai_client(real_server, hf):
    """echo + logprobs + max_tokens 0 on a batch of prompts, one longer than the prefill chunk: the
    response is the prompts alone, with every prompt token's logprob."""
    model, tokenizer = hf
    texts = ["The quick brown fox jumps over the lazy dog", "def f(x):\n    return x * 2\n" * 5, "naïve 🙂"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert len(ids[1]) > CHUNK

    async def go():
        client = AsyncOpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        async with client:
            return await client.completions.create(
                model="tiny-llama", prompt=texts, echo=True, logprobs=2, max_tokens=0, temperature=0.0
            )

    r = asyncio.run(go())
    assert len(r.choices) == 3
    for choice, text, prompt_ids in zip(sorted(r.choices, key=lambda c: c.index), texts, ids, strict=True):
        assert choice.text == text  # the prompt alone: nothing generated shows
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(prompt_ids)
        _assert_scores(model, prompt_ids, lp.token_logprobs, lp.top_logprobs, 2)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    real_server.wait_until_idle()


def test_prompt_logprobs_field_and_echo_with_generation(real_server, hf):
    """vLLM's `prompt_logprobs` on the choice ({token id: {logprob, rank, decoded_token}}), with echo and
    generated tokens after the prompt's."""
    model, tokenizer = hf
    prompt = list(range(5, 5 + 40))  # token ids, longer than a chunk
    status, r = _post(
        real_server,
        {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "prompt_logprobs": 3,
         "temperature": 0.0, "ignore_eos": True},
    )  # fmt: skip
    assert status == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    _assert_scores(model, prompt, lp["token_logprobs"], None, 1)
    assert all(v is not None for v in lp["token_logprobs"][len(prompt) :])  # the generated tokens'
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    ref = _reference(model, prompt)
    for t in range(1, len(prompt)):
        entry = scored[t]
        mine = entry[str(prompt[t])]
        assert mine["logprob"] == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
        assert mine["rank"] == int((ref[t - 1] > ref[t - 1, prompt[t]]).sum()) + 1
        assert mine["decoded_token"] == tokenizer.convert_ids_to_tokens(prompt[t]) or mine["decoded_token"]
        top = ref[t - 1].topk(3)
        for rank, (token_id, value) in enumerate(
            zip(top.indices.tolist(), top.values.tolist(), strict=True), 1
        ):
            if str(token_id) in entry and str(token_id) != str(prompt[t]):
                assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
                assert entry[str(token_id)]["rank"] == rank
        assert 3 <= len(entry) <= 4
    real_server.wait_until_idle()


def test_prompt_logprobs_do_not_take_prefix_cache_hits(real_server, hf):
    """The same long prompt twice: the second, scored, computes it all again (no cached tokens) and scores
    the same; a third without scoring takes the hit."""
    model, _ = hf
    prompt = list(range(100, 100 + 70))
    plain = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    assert _post(real_server, plain)[0] == 200
    status, r = _post(real_server, {**plain, "echo": True, "logprobs": 0})
    assert status == 200, r
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _assert_scores(model, prompt, r["choices"][0]["logprobs"]["token_logprobs"], None, 0)
    status, r = _post(real_server, plain)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    real_server.wait_until_idle()


def test_streamed_echo_starts_with_the_prompt(real_server, hf):
    model, tokenizer = hf
    text = "Once upon a time"
    ids = tokenizer(text)["input_ids"]
    body = {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(
        real_server.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(text)
    token_logprobs = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(token_logprobs) == len(ids) + 2
    _assert_scores(model, ids, token_logprobs, None, 1)
    real_server.wait_until_idle()


def test_chat_prompt_logprobs_on_the_response(real_server, hf):
    """vLLM's chat `prompt_logprobs`: on the response, for the rendered conversation's tokens."""
    model, tokenizer = hf
    messages = [{"role": "user", "content": "Say something."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    req = urllib.request.Request(
        real_server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        r = json.loads(resp.read())
    scored = r["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    ref = _reference(model, ids)
    got = [scored[t][str(ids[t])]["logprob"] for t in range(1, len(ids))]
    assert got == pytest.approx([ref[t - 1, ids[t]].item() for t in range(1, len(ids))], abs=1e-4)
    assert all(len(entry) == 1 for entry in scored[1:])  # k = 0: the token alone
    real_server.wait_until_idle()
