"""POST /v1/completions against the fake scheduler, which echoes the prompt as its output."""

from __future__ import annotations

from typing import Any

from pagedserve.common.messages import AbortRequest
from tests.api.harness import ApiServer, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog"


def echo(prompt: list[int], count: int, index: int = 0) -> list[int]:
    """The fake scheduler's output: the prompt again, from position `index`."""
    return [prompt[(index + k) % len(prompt)] for k in range(count)]


def test_completion_returns_the_decoded_text_and_usage(server: ApiServer, tokenizer: Any) -> None:
    reply = server.post("/v1/completions", {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 7})
    assert reply.status == 200 and reply.content_type.startswith("application/json")
    body = reply.json()
    ids = tokenizer(PROMPT)["input_ids"]
    assert server.fake.submits()[-1].prompt_token_ids == ids
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny-llama" and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": tokenizer.decode(echo(ids, 7), skip_special_tokens=True),
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 7,
        "total_tokens": len(ids) + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_max_tokens_defaults_to_16_as_openai_and_vllm(server: ApiServer) -> None:
    body = server.post("/v1/completions", {"prompt": list(range(1, 11))}).json()
    assert server.fake.submits()[-1].params.max_tokens == 16
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_is_cut_to_the_rest_of_the_context(server: ApiServer) -> None:
    body = server.post("/v1/completions", {"prompt": list(range(1, 251))}).json()
    assert server.fake.submits()[-1].params.max_tokens == 256 - 250
    assert body["usage"]["completion_tokens"] == 6


def test_chat_max_tokens_defaults_to_what_fits_the_kv_pool(make_server: Any) -> None:
    server = make_server(num_kv_blocks=4)  # 64 tokens of KV, less than the 256-token context
    messages = [{"role": "user", "content": "hi"}]
    body = server.post("/v1/chat/completions", {"messages": messages}).json()
    submitted = server.fake.submits()[-1]
    assert submitted.params.max_tokens == 64 - len(submitted.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == submitted.params.max_tokens


def test_stream_is_framed_as_sse_and_adds_up_to_the_full_text(server: ApiServer) -> None:
    request = {"prompt": PROMPT, "max_tokens": 12, "seed": 3}
    full = server.post("/v1/completions", request).json()
    events = server.stream("/v1/completions", request)
    assert len(events) > 1
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert all("usage" not in e for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_include_usage_adds_a_final_usage_chunk(server: ApiServer, tokenizer: Any) -> None:
    prompt = "a prompt no other test sends, so nothing of it is cached"
    events = server.stream(
        "/v1/completions", {"prompt": prompt, "max_tokens": 5, "stream_options": {"include_usage": True}}
    )
    *chunks, last = events
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_n_and_a_batch_of_prompts_number_the_choices(server: ApiServer, tokenizer: Any) -> None:
    prompts = [[100, 200, 300], [400, 500]]
    body = server.post("/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 4}).json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    expected = [tokenizer.decode(echo(p, 4, i)) for p in prompts for i in range(2)]
    assert texts == expected
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16

    events = server.stream("/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 4})
    streamed = {i: "" for i in range(4)}
    for e in events:
        [choice] = e["choices"]
        streamed[choice["index"]] += choice["text"]
    assert list(streamed.values()) == expected


def test_stop_string_truncates_the_text_and_stops_the_sequence(server: ApiServer, tokenizer: Any) -> None:
    prompt = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    full = tokenizer.decode(echo(prompt, 30))
    expected = full[: full.index("amma d")]
    request = {"prompt": prompt, "max_tokens": 30, "stop": ["amma d", "zzz"]}

    body = server.post("/v1/completions", request).json()
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    request_id = server.fake.submits()[-1].request_id
    assert wait_until(lambda: AbortRequest(request_id, 0, "stop") in server.fake.aborts())

    events = server.stream("/v1/completions", request)
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == expected and not any("amm" in t for t in texts)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_sequence(server: ApiServer) -> None:
    body = server.post("/v1/completions", {"prompt": [10, 20, 30, 40], "stop_token_ids": [30]}).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 3


def test_logprobs_follow_the_legacy_shape(server: ApiServer, tokenizer: Any) -> None:
    prompt = tokenizer.encode(" one two three", add_special_tokens=False)
    body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 5, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([t]) for t in echo(prompt, 5)]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-0.25, -0.5, -0.75, -1.0, -0.25]
    assert all(
        len(top) == 2 and top[tok] == lp
        for top, tok, lp in zip(logprobs["top_logprobs"], tokens, logprobs["token_logprobs"], strict=True)
    )
    offsets = [0]
    for tok in tokens[:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert logprobs["text_offset"] == offsets

    events = server.stream("/v1/completions", {"prompt": prompt, "max_tokens": 5, "logprobs": 2})
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == tokens


def test_cached_prompt_tokens_are_reported(server: ApiServer) -> None:
    prompt = list(range(500, 540))  # 40 tokens: the fake caches whole 16-token blocks of a repeated prompt
    first = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    second = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
