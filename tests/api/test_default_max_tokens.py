"""A chat request without max_tokens generates at most --default-max-tokens (4096) tokens, fewer when less
fits in the context or the checkpoint's max_new_tokens is smaller, never the whole of a long context."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import openai
import pytest

from pagedserve.api.generation_config import GenerationDefaults
from pagedserve.api.sampling_fields import default_max_tokens
from pagedserve.common.config import ApiConfig

USER = [{"role": "user", "content": "hi"}]


def chat_max_tokens(api: Any, **body: Any) -> int:
    reply = api.post("/v1/chat/completions", {"messages": USER, **body})
    assert reply.status == 200, reply.text
    return int(api.fake.submits()[-1].params.max_tokens)


def test_a_long_context_is_not_the_default(make_server: Any) -> None:
    # The fake ends each sequence after its scripted token (a stop), so no 4096 tokens are generated here
    api = make_server(max_model_len=32768, num_kv_blocks=4096, scripted=(5,))
    assert chat_max_tokens(api) == 4096
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(model="tiny-llama", messages=USER)  # type: ignore[arg-type]
    assert answer.choices[0].finish_reason == "stop"
    assert api.fake.submits()[-1].params.max_tokens == 4096


def test_the_default_is_a_setting_and_never_caps_what_is_asked(make_server: Any) -> None:
    api = make_server(ApiConfig(default_max_tokens=6), max_model_len=2048, num_kv_blocks=512)
    assert chat_max_tokens(api) == 6
    assert chat_max_tokens(api, max_tokens=100) == 100
    assert chat_max_tokens(api, max_completion_tokens=7) == 7


def test_a_short_context_cuts_it_to_what_fits(make_server: Any) -> None:
    api = make_server(max_model_len=48)
    prompt_tokens = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}).json()["usage"]
    assert chat_max_tokens(api) == 48 - prompt_tokens["prompt_tokens"]


def test_zero_means_as_much_as_fits(make_server: Any) -> None:
    api = make_server(ApiConfig(default_max_tokens=0), max_model_len=8192, num_kv_blocks=1024, scripted=(5,))
    prompt_tokens = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}).json()["usage"]
    assert chat_max_tokens(api) == 8192 - prompt_tokens["prompt_tokens"]


def test_the_default_is_cut_to_the_kv_pool_too(make_server: Any) -> None:
    api = make_server(max_model_len=8192, num_kv_blocks=128, scripted=(5,))  # 2048 tokens of KV
    prompt_tokens = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}).json()["usage"]
    assert chat_max_tokens(api) == 2048 - prompt_tokens["prompt_tokens"]


@pytest.mark.parametrize(
    ("max_new_tokens", "cap", "expected"),
    [(None, 4096, 4096), (40, 4096, 40), (10_000, 4096, 4096), (10_000, 0, 10_000), (None, 0, 0)],
)
def test_the_checkpoints_max_new_tokens_and_the_cap_the_smaller_wins(
    max_new_tokens: int | None, cap: int, expected: int
) -> None:
    model = SimpleNamespace(generation_defaults=GenerationDefaults(max_tokens=max_new_tokens))
    assert default_max_tokens(model, cap) == expected  # type: ignore[arg-type]


def test_a_negative_default_is_refused() -> None:
    with pytest.raises(ValueError, match="default_max_tokens"):
        ApiConfig(default_max_tokens=-1)
