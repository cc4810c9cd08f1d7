"""POST /tokenize and /detokenize against the checkpoint's own tokenizer (transformers'), in vLLM's shapes;
the chat form against what /v1/chat/completions sends the scheduler and against transformers' template."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.api.model import longest_token_chars
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error

TEXTS = ["Hello world", "", "  two  spaces\tand a tab\n", "naïve café – 日本語 🙂", "<|begin_of_text|>inline"]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block table?"}]


def tokenize(server: ApiServer, body: dict[str, Any]) -> dict[str, Any]:
    reply = server.post("/tokenize", body)
    assert reply.status == 200, reply.text
    return reply.json()


def detokenize(server: ApiServer, tokens: list[int]) -> str:
    reply = server.post("/detokenize", {"model": "tiny-llama", "tokens": tokens})
    assert reply.status == 200, reply.text
    assert set(reply.json()) == {"prompt"}
    return reply.json()["prompt"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_is_the_tokenizers_encoding(server: ApiServer, tokenizer: Any, text: str) -> None:
    answer = tokenize(server, {"model": "tiny-llama", "prompt": text})
    expected = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert answer == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    assert answer["tokens"][0] == tokenizer.bos_token_id  # add_special_tokens defaults to true, as in vLLM
    plain = tokenize(server, {"prompt": text, "add_special_tokens": False})["tokens"]
    assert plain == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_token_strs_are_the_vocabulary_pieces_when_asked(server: ApiServer, tokenizer: Any) -> None:
    answer = tokenize(server, {"prompt": "Hello world", "return_token_strs": True})
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert answer["token_strs"][0] == tokenizer.bos_token


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_round_trips_and_keeps_special_tokens(
    server: ApiServer, tokenizer: Any, text: str
) -> None:
    plain = tokenize(server, {"prompt": text, "add_special_tokens": False})["tokens"]
    assert detokenize(server, plain) == text  # a byte-level BPE decodes back to the very text
    with_bos = tokenize(server, {"prompt": text})["tokens"]
    assert detokenize(server, with_bos) == tokenizer.decode(with_bos) == tokenizer.bos_token + text


def test_detokenize_of_any_ids_is_the_tokenizers_decode(server: ApiServer, tokenizer: Any) -> None:
    ids = [5, 4095, 17, tokenizer.eos_token_id, 300, 0]
    assert detokenize(server, ids) == tokenizer.decode(ids)
    assert detokenize(server, []) == ""


def test_chat_form_is_what_chat_completions_feeds_the_model(server: ApiServer, tokenizer: Any) -> None:
    answer = tokenize(server, {"model": "tiny-llama", "messages": USER, "return_token_strs": True})
    assert server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}).status == 200
    assert answer["tokens"] == server.fake.submits()[-1].prompt_token_ids
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 256
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False}
    assert tokenize(server, {"messages": USER, **defaults})["tokens"] == answer["tokens"]
    # the template controls and tools reach the template as on /v1/chat/completions
    bare = tokenize(server, {"messages": USER, "add_generation_prompt": False})["tokens"]
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=False, tokenize=False)
    assert bare == tokenizer(text, add_special_tokens=False)["input_ids"] != answer["tokens"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = tokenize(server, {"messages": USER, "tools": [tool]})["tokens"]
    text = tokenizer.apply_chat_template(USER, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert with_tools == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_long_body_is_tokenized_off_the_event_loop_alike(make_server: Any, tokenizer: Any) -> None:
    api = make_server(max_model_len=16384)
    text = "the block manager owns the free list. " * 600  # over the 16 KiB parsed inline
    assert tokenize(api, {"prompt": text})["tokens"] == tokenizer(text)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 4096 and detokenize(api, ids) == text


BAD_TOKENIZE = [
    ("a list body", [1, 2]),
    ("no prompt", {"model": "tiny-llama"}),
    ("prompt as ids", {"prompt": [1, 2, 3]}),
    ("prompt as a number", {"prompt": 7}),
    ("prompt and messages", {"prompt": "a", "messages": USER}),
    ("a refused field", {"prompt": "a", "truncate_prompt_tokens": 1}),
    ("chat field on text", {"prompt": "a", "add_generation_prompt": True}),
    ("add_special_tokens as a string", {"prompt": "a", "add_special_tokens": "yes"}),
    ("return_token_strs as 1", {"prompt": "a", "return_token_strs": 1}),
    ("messages not a list", {"messages": "hi"}),
    ("empty messages", {"messages": []}),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("continue and generation prompt", {"messages": USER, "continue_final_message": True}),
    ("special tokens on chat", {"messages": USER, "add_special_tokens": True}),
    ("chat_template", {"messages": USER, "chat_template": "{{ messages }}"}),  # untrusted: refused
    ("tools not a list", {"messages": USER, "tools": {"type": "function"}}),
]


@pytest.mark.parametrize(("name", "body"), BAD_TOKENIZE, ids=[n for n, _ in BAD_TOKENIZE])
def test_bad_tokenize_bodies_are_400s(server: ApiServer, name: str, body: Any) -> None:
    assert_error(server.post("/tokenize", body), 400)


def test_tokenize_refusals_say_why(server: ApiServer) -> None:
    both = {"messages": USER, "add_generation_prompt": True, "continue_final_message": True}
    error = assert_error(server.post("/tokenize", both), 400)
    assert error["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    error = assert_error(server.post("/tokenize", {"prompt": "a", "messages": USER}), 400)
    assert error["message"] == "Only one of `prompt` or `messages` should be provided."
    error = assert_error(server.post("/tokenize", {"prompt": "a", "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found"


BAD_DETOKENIZE = [
    ("no tokens", {"model": "tiny-llama"}),
    ("tokens as text", {"tokens": "1 2 3"}),
    ("a token past the vocabulary", {"tokens": [1, 4096]}),
    ("a negative token", {"tokens": [-1]}),
    ("a bool token", {"tokens": [True]}),
    ("a float token", {"tokens": [1.0]}),
    ("nested tokens", {"tokens": [[1]]}),
    ("more tokens than the context", {"tokens": [1] * 257}),
    ("unknown field", {"tokens": [1], "skip_special_tokens": True}),
]


@pytest.mark.parametrize(("name", "body"), BAD_DETOKENIZE, ids=[n for n, _ in BAD_DETOKENIZE])
def test_bad_detokenize_bodies_are_400s(server: ApiServer, name: str, body: Any) -> None:
    error = assert_error(server.post("/detokenize", body), 400)
    assert error["param"] in ("tokens", "skip_special_tokens")


def test_a_text_longer_than_any_context_is_refused_before_tokenizing(
    make_server: Any, tokenizer: Any
) -> None:
    api = make_server(max_model_len=8)
    limit = 8 * longest_token_chars(tokenizer)
    assert len(tokenize(api, {"prompt": "x" * limit})["tokens"]) > 8  # counted, though it cannot fit
    error = assert_error(api.post("/tokenize", {"prompt": "x" * (limit + 1)}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert api.post("/detokenize", {"tokens": [1] * 8}).status == 200
    assert_error(api.post("/detokenize", {"tokens": [1] * 9}), 400)


def test_both_need_the_api_key(tiny_model_dir: Any) -> None:
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key="sk-tok"))
    try:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert_error(api.post(path, body), 401)
            assert_error(api.post(path, body, headers={"Authorization": "Bearer wrong"}), 401)
            assert api.post(path, body, headers={"Authorization": "Bearer sk-tok"}).status == 200
    finally:
        api.close()


def test_methods_and_paths_are_vllms(server: ApiServer) -> None:
    assert_error(server.get("/tokenize"), 405)
    assert_error(server.post("/v1/tokenize", {"prompt": "a"}), 404)  # vLLM serves them at the root only
