"""The logits processors' fields (presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens,
logit_bias, bad_words, allowed_token_ids) reach the scheduler from both endpoints as SamplingParams, every
out-of-range value is a 400 naming its field, and the checkpoint's generation_config.json gives the defaults
of what a request leaves out (--generation-config auto), or not (none). What each field does to the logits
is tested against references in tests/test_logits_processors.py and tests/test_processors_engine.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error

USER = [{"role": "user", "content": "tell me about the block manager"}]
ENDPOINTS = {"completions": {"prompt": "abc", "max_tokens": 20}, "chat": {"messages": USER, "max_tokens": 20}}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def submitted(server: ApiServer, endpoint: str, **fields: Any) -> Any:
    reply = server.post(PATHS[endpoint], {**ENDPOINTS[endpoint], **fields})
    assert reply.status == 200, reply.text
    return server.fake.submits()[-1].params


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_reaches_the_sampling_params(server: ApiServer, endpoint: str) -> None:
    params = submitted(
        server,
        endpoint,
        presence_penalty=-1.5,
        frequency_penalty=2,
        repetition_penalty=1.25,
        min_p=0.1,
        min_tokens=20,
        logit_bias={"7": -100, "11": 2.5},
        allowed_token_ids=[5, 7, 11],
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (-1.5, 2.0, 1.25)
    assert (params.min_p, params.min_tokens, params.max_tokens) == (0.1, 20, 20)
    assert params.logit_bias == ((7, -100.0), (11, 2.5))
    assert params.allowed_token_ids == (5, 7, 11)
    assert params.validate() is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_omitted_fields_leave_the_logits_alone(server: ApiServer, endpoint: str) -> None:
    params = submitted(server, endpoint)
    assert not params.processed and not params.penalized


def vllm_bad_words(tokenizer: Any, words: list[str]) -> list[tuple[int, ...]]:
    """vLLM's rule: the word without leading spaces, and with one space before it when that is another
    first token and as many tokens."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return out


def test_bad_words_are_tokenized_as_vllm_does(server: ApiServer, tokenizer: Any) -> None:
    words = ["hello", " world", "block manager", "\u00e9t\u00e9"]
    params = submitted(server, "completions", bad_words=words)
    assert list(params.bad_words) == vllm_bad_words(tokenizer, words)
    assert any(len(w) > 1 for w in params.bad_words) and params.penalized


BAD_VALUES = [
    ("presence_penalty", 2.1),
    ("presence_penalty", "1"),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("repetition_penalty", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("min_tokens", 21),  # past max_tokens
    ("logit_bias", [1, 2]),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1000000": 1}),  # past the vocabulary
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", {"5": 1, "05": 2}),  # one token twice
    ("logit_bias", {str(t): 1 for t in range(1025)}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", [1000000]),
    ("allowed_token_ids", "5"),
    ("allowed_token_ids", list(range(1 << 16 + 1))),
    ("bad_words", "word"),
    ("bad_words", [""]),
    ("bad_words", ["   "]),
    ("bad_words", [5]),
    ("bad_words", ["w"] * 65),
    ("bad_words", ["x" * 1025]),
    ("bad_words", ["block " * 40]),  # more tokens than a bad word may have
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={str(v)[:20]}" for n, v in BAD_VALUES])
def test_out_of_range_values_get_400_naming_the_field(
    server: ApiServer, endpoint: str, name: str, value: Any
) -> None:
    reply = server.post(PATHS[endpoint], {**ENDPOINTS[endpoint], name: value})
    assert assert_error(reply, 400)["param"] == name


def test_processors_with_beam_search_get_400(server: ApiServer) -> None:
    body = {"prompt": "abc", "max_tokens": 4, "use_beam_search": True, "best_of": 2, "presence_penalty": 1.0}
    assert_error(server.post("/v1/completions", body), 400)


@pytest.fixture(scope="module")
def defaults_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with sampling defaults in its generation_config.json, as Qwen's have."""
    from transformers import GenerationConfig

    model_dir = tmp_path_factory.mktemp("generation-config") / "tiny-llama"
    shutil.copytree(tiny_model_dir, model_dir)
    config = GenerationConfig.from_pretrained(model_dir)
    config.update(
        do_sample=True,
        temperature=0.6,
        top_p=0.8,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.05,
        max_new_tokens=40,
    )
    config.save_pretrained(model_dir)
    return model_dir


def test_generation_config_gives_the_defaults_of_what_a_request_leaves_out(defaults_model_dir: Path) -> None:
    server = ApiServer(str(defaults_model_dir))
    try:
        for endpoint in ("completions", "chat"):
            request = {k: v for k, v in ENDPOINTS[endpoint].items() if k != "max_tokens"}
            assert server.post(PATHS[endpoint], request).status == 200
            params = server.fake.submits()[-1].params
            got = (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty)
            assert got == pytest.approx((0.6, 0.8, 20, 0.05, 1.05))
            # completions: OpenAI's 16; chat: max_new_tokens
            assert params.max_tokens == (16 if endpoint == "completions" else 40)
        overridden = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
        params = submitted(server, "chat", **overridden, max_tokens=100)
        got = (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty)
        assert got == (1.0, 1.0, 0, 0.0, 1.0)
        assert params.max_tokens == 100  # max_new_tokens is a default, not a cap, as in vLLM
        # beam search takes none of them: a beam's candidates are the raw distribution's
        body = {"prompt": "abc", "max_tokens": 4, "use_beam_search": True, "best_of": 2}
        assert server.post("/v1/completions", body).status == 200
        params = server.fake.submits()[-1].params
        assert (params.temperature, params.repetition_penalty, params.min_p, params.top_k) == (
            0.0,
            1.0,
            0.0,
            0,
        )
    finally:
        server.close()


def test_generation_config_none_keeps_our_defaults(defaults_model_dir: Path) -> None:
    server = ApiServer(str(defaults_model_dir), ApiConfig(generation_config="none"))
    try:
        params = submitted(server, "chat")
        assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
        assert params.repetition_penalty == 1.0
    finally:
        server.close()


def test_generation_config_values_out_of_range_are_left_out(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pagedserve.api.generation_config import load_generation_defaults

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    text = (model_dir / "generation_config.json").read_text()
    (model_dir / "generation_config.json").write_text(
        text.rstrip().rstrip("}") + ', "repetition_penalty": 5.0, "top_p": 0.5, "top_k": 50}'
    )
    defaults = load_generation_defaults(str(model_dir), "auto")
    assert defaults.as_dict() == {"top_p": 0.5, "top_k": 50}  # repetition_penalty 5.0 is out of range
    assert load_generation_defaults(str(model_dir), "none").as_dict() == {}
