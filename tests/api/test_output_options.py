"""The output options against the fake scheduler (which generates the prompt again, from its start):
`skip_special_tokens`, `spaces_between_special_tokens` and `include_stop_str_in_output` against the
tokenizer's own decode, `return_tokens_as_token_ids` in completions and chat, `echo` without prompt
logprobs, and every new field's out-of-range value a 400 naming it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.api.harness import ApiServer


def _special(tokenizer: Any) -> list[int]:
    return tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_text_options_decode_as_the_tokenizer_does(server: ApiServer, tokenizer: Any, skip, spaces) -> None:
    bos, eot = _special(tokenizer)
    prompt = tokenizer.encode(" one", add_special_tokens=False) + [eot, bos] + tokenizer.encode(" two")
    request = {
        "prompt": prompt, "max_tokens": len(prompt), "skip_special_tokens": skip,
        "spaces_between_special_tokens": spaces,
    }  # fmt: skip
    expected = tokenizer.decode(
        prompt,
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
        clean_up_tokenization_spaces=False,
    )
    assert server.post("/v1/completions", request).json()["choices"][0]["text"] == expected
    streamed = server.stream("/v1/completions", request)
    assert "".join(e["choices"][0]["text"] for e in streamed) == expected
    params = server.fake.submits()[-1].params
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (skip, spaces)


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(
    server: ApiServer, tokenizer: Any
) -> None:
    prompt = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    full = tokenizer.decode(prompt)
    request = {"prompt": prompt, "max_tokens": 30, "stop": ["amma d"]}
    for include, expected in (
        (False, full[: full.index("amma d")]),
        (True, full[: full.index("amma d") + 6]),
    ):
        body = server.post("/v1/completions", {**request, "include_stop_str_in_output": include}).json()
        assert body["choices"][0]["text"] == expected
        events = server.stream("/v1/completions", {**request, "include_stop_str_in_output": include})
        assert "".join(e["choices"][0]["text"] for e in events) == expected
    # a stop token's text: left out, as vLLM does, unless asked for
    stop = {"prompt": prompt, "stop_token_ids": [prompt[2]], "max_tokens": 10}
    plain = server.post("/v1/completions", stop).json()["choices"][0]
    kept = server.post("/v1/completions", {**stop, "include_stop_str_in_output": True}).json()["choices"][0]
    assert plain["finish_reason"] == kept["finish_reason"] == "stop"
    assert plain["text"] == tokenizer.decode(prompt[:2]) and kept["text"] == tokenizer.decode(prompt[:3])


def test_return_tokens_as_token_ids(server: ApiServer, tokenizer: Any) -> None:
    prompt = tokenizer.encode(" one two three", add_special_tokens=False)
    request = {"prompt": prompt, "max_tokens": 3, "logprobs": 2, "return_tokens_as_token_ids": True}
    logprobs = server.post("/v1/completions", request).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in prompt]
    assert all(all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = server.post("/v1/chat/completions", {**chat, "return_tokens_as_token_ids": True}).json()
    entries = content["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3
    for entry in entries:
        assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]).decode() == entry["token"]
        assert all(alt["token"].startswith("token_id:") for alt in entry["top_logprobs"])


def test_openai_client_parses_chat_logprobs(server: ApiServer) -> None:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        r = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
            top_logprobs=3,
        )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.bytes is not None and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob


def test_echo_without_logprobs_prepends_the_prompt(server: ApiServer, tokenizer: Any) -> None:
    text = "The quick brown fox"
    prompt = tokenizer.encode(text)
    body = server.post("/v1/completions", {"prompt": text, "max_tokens": 3, "echo": True}).json()
    assert body["choices"][0]["text"] == text + tokenizer.decode(prompt[:3], skip_special_tokens=True)
    assert server.fake.submits()[-1].params.prompt_logprobs is None  # no logprobs: nothing to score
    only = server.post(
        "/v1/completions", {"prompt": [prompt, prompt[1:]], "max_tokens": 0, "echo": True}
    ).json()
    assert [c["text"] for c in only["choices"]] == [text, tokenizer.decode(prompt[1:])]
    assert server.fake.submits()[-1].params.max_tokens == 1  # one token generated, none shown
    events = server.stream("/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True})
    assert "".join(e["choices"][0]["text"] for e in events) == text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": "5"}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"echo": 1}, "echo"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/v1/completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ("/v1/completions", {"skip_special_tokens": 0}, "skip_special_tokens"),
        (
            "/v1/completions",
            {"spaces_between_special_tokens": None, "skip_special_tokens": []},
            "skip_special_tokens",
        ),
        ("/v1/completions", {"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"),
        ("/v1/completions", {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
        ("/v1/chat/completions", {"prompt_logprobs": 99}, "prompt_logprobs"),
        ("/v1/chat/completions", {"return_tokens_as_token_ids": "true"}, "return_tokens_as_token_ids"),
        ("/v1/chat/completions", {"skip_special_tokens": 1.0}, "skip_special_tokens"),
    ],
)
def test_out_of_range_output_options_are_400(server: ApiServer, path: str, body: dict, param: str) -> None:
    base = (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    reply = server.post(path, {**base, "max_tokens": 2, **body})
    assert reply.status == 400, reply.json()
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_echo_logprobs_stay_aligned_with_their_tokens(server: ApiServer, tokenizer: Any) -> None:
    """The fake scheduler scores no prompt: the prompt's entries are null, the generated ones line up."""
    prompt = tokenizer.encode(" one two three", add_special_tokens=False)
    body = {"prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True}
    logprobs = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert server.fake.submits()[-1].params.prompt_logprobs == 1  # echo + logprobs asks for them
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 2
    assert logprobs["token_logprobs"][: len(prompt)] == [None] * len(prompt)
    assert logprobs["token_logprobs"][len(prompt) :] == [-0.25, -0.5]
