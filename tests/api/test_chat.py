"""POST /v1/chat/completions: template rendering, the role chunk, logprobs and usage."""

from __future__ import annotations

from typing import Any

from tests.api.harness import ApiServer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours 🙂"},
]


def rendered(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def echo(prompt: list[int], count: int, start: int) -> list[int]:
    return [prompt[(start + k) % len(prompt)] for k in range(count)]


def test_messages_are_rendered_once_with_the_chat_template(server: ApiServer, tokenizer: Any) -> None:
    reply = server.post(
        "/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 3}
    )
    assert reply.status == 200, reply.text
    prompt = server.fake.submits()[-1].prompt_token_ids
    assert prompt == rendered(tokenizer, MESSAGES)
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert prompt.count(bos) == 1  # the template's BOS, not a second one from tokenization
    assert tokenizer.decode(prompt).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_text_parts_and_developer_role_are_accepted(server: ApiServer, tokenizer: Any) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1}).status == 200
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert server.fake.submits()[-1].prompt_token_ids == rendered(tokenizer, expected)


def test_chat_response_and_usage(make_server: Any, tokenizer: Any) -> None:
    server = make_server(output_start=2)  # the echo starts at the role name, after two special tokens
    body = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 6}).json()
    prompt = rendered(tokenizer, MESSAGES)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    content = tokenizer.decode(echo(prompt, 6, 2), skip_special_tokens=True)
    assert content.startswith("system")
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 6


def test_stream_starts_with_the_role_together_with_the_first_token(make_server: Any, tokenizer: Any) -> None:
    server = make_server(output_start=5)  # both sequences start on text tokens of the system message
    request = {"messages": MESSAGES, "max_tokens": 8, "n": 2, "stream_options": {"include_usage": True}}
    events = server.stream("/v1/chat/completions", request)
    full = server.post("/v1/chat/completions", {**request, "stream_options": None}).json()
    *chunks, usage = events
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        first_token = echo(rendered(tokenizer, MESSAGES), 1, 5 + index)
        assert mine[0]["delta"] == {"role": "assistant", "content": tokenizer.decode(first_token)}
        assert mine[0]["delta"]["content"]  # the role did not come alone
        assert all("role" not in c["delta"] for c in mine[1:])
        content = "".join(c["delta"].get("content", "") for c in mine)
        assert content == full["choices"][index]["message"]["content"]
        assert mine[-1]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16


def test_chat_logprobs_have_tokens_bytes_and_alternatives(server: ApiServer, tokenizer: Any) -> None:
    request = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    body = server.post("/v1/chat/completions", request).json()
    content = body["choices"][0]["logprobs"]["content"]
    generated = echo(rendered(tokenizer, MESSAGES), 4, 0)
    assert len(content) == 4
    for entry, token_id in zip(content, generated, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert entry["token"] == tokenizer.decode([token_id])
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == [entry["logprob"], entry["logprob"] - 1]

    events = server.stream("/v1/chat/completions", request)
    streamed = [e for c in events for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
