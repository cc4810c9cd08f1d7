"""`stop_reason` on every choice, as vLLM writes it: the stop string or the stop token id that ended the
choice, null when the tokenizer's EOS or the length ended it; in streams on every chunk, set on the last."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.api.harness import ApiServer

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def eos(tokenizer: Any) -> int:
    return int(tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def api(tiny_model_dir: Any, eos: int) -> Iterator[ApiServer]:
    """The fake ends on the tokenizer's EOS and on 9, another EOS id (as generation_config's may add)."""
    server = ApiServer(str(tiny_model_dir), eos_token_ids=(eos, 9))
    yield server
    server.close()


def completion(api: ApiServer, **body: Any) -> dict[str, Any]:
    reply = api.post("/v1/completions", {"max_tokens": 8, **body})
    assert reply.status == 200, reply.text
    return dict(reply.json()["choices"][0])


def test_a_stop_token_id_is_the_reason(api: ApiServer) -> None:
    choice = completion(api, prompt=[5, 6, 7, 8], stop_token_ids=[7])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 7)


def test_a_stop_string_is_the_reason(api: ApiServer, tokenizer: Any) -> None:
    prompt = tokenizer("hello world again", add_special_tokens=False)["input_ids"]
    choice = completion(api, prompt=prompt, stop=["nothing", " wor"])
    assert choice["text"] == "hello" and (choice["finish_reason"], choice["stop_reason"]) == ("stop", " wor")


def test_eos_and_length_have_none(api: ApiServer, eos: int) -> None:
    choice = completion(api, prompt=[5, eos, 6], stop_token_ids=[eos])  # EOS first, as vLLM checks it
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    choice = completion(api, prompt=[5, 6], max_tokens=3)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


def test_another_eos_id_is_named_as_vllm_names_it(api: ApiServer) -> None:
    choice = completion(api, prompt=[5, 9, 6])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 9)


def test_streams_name_it_on_the_last_chunk(api: ApiServer) -> None:
    events = api.stream("/v1/completions", {"prompt": [5, 6, 7, 8], "stop_token_ids": [8], "max_tokens": 8})
    reasons = [e["choices"][0]["stop_reason"] for e in events]
    assert reasons[-1] == 8 and set(reasons[:-1]) == {None}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_names_it_streamed_or_not(make_server: Any, tokenizer: Any, eos: int) -> None:
    words = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    chat = make_server(scripted=tuple(words), eos_token_ids=(eos,))
    body = {"messages": USER, "max_tokens": 20, "stop": [" three"]}
    reply = chat.post("/v1/chat/completions", body)
    [choice] = reply.json()["choices"]
    assert choice["message"]["content"] == "one two" and choice["stop_reason"] == " three"
    events = chat.stream("/v1/chat/completions", body)
    assert events[-1]["choices"][0]["stop_reason"] == " three"
    assert {e["choices"][0]["stop_reason"] for e in events[:-1]} == {None}
    [choice] = chat.post("/v1/chat/completions", {"messages": USER, "max_tokens": 20}).json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)  # the scripted EOS


def test_the_openai_client_reads_it(api: ApiServer) -> None:
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        request: Any = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 8}
        answer = client.completions.create(**request, extra_body={"stop_token_ids": [6]})
        last = list(client.completions.create(**request, stream=True, extra_body={"stop_token_ids": [6]}))[-1]
    assert answer.choices[0].model_extra == {"stop_reason": 6}
    assert last.choices[0].model_extra == {"stop_reason": 6}


def test_the_rule() -> None:
    from pagedserve.api.openai_format import stop_reason

    assert stop_reason("stop", "###", [4, 5], eos_token_id=2) == "###"
    assert stop_reason("stop", None, [4, 5], eos_token_id=2) == 5
    assert stop_reason("stop", None, [4, 2], eos_token_id=2) is None
    assert stop_reason("length", None, [4, 5], eos_token_id=2) is None
    assert stop_reason("abort", "###", [], eos_token_id=2) is None
    assert stop_reason(None, None, [4], eos_token_id=2) is None
