"""Chat-template controls: --chat-template, a request's own template (only when trusted, and bounded),
chat_template_kwargs, add_generation_prompt, continue_final_message, documents; the reasoning parsers
through the api; and the 400s for what is refused. transformers' apply_chat_template is the reference."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pagedserve.api import chat_template
from pagedserve.common.config import ApiConfig
from tests.api.chat_templates import HERMES, checkpoint_with_template
from tests.api.harness import ApiServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
DOCUMENTS_TEMPLATE = (
    "{% for d in documents %}[DOC {{ d.title }}] {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_dir(tiny_model_dir: Path, tmp_path_factory: Any) -> Path:
    return checkpoint_with_template(tiny_model_dir, tmp_path_factory.mktemp("hermes") / "ckpt", HERMES)


@pytest.fixture(scope="module")
def qwen_server(hermes_dir: Path) -> Iterator[ApiServer]:
    """A Qwen-style template (tools, <think>) and the qwen3 reasoning parser with hermes tool calls."""
    config = ApiConfig(
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        trust_request_chat_template=True,
    )
    server = ApiServer(str(hermes_dir), config, max_model_len=2048, num_kv_blocks=1024)
    yield server
    server.close()


@pytest.fixture(scope="module")
def qwen_tokenizer(hermes_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hermes_dir))


def reference(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, **{"add_generation_prompt": True, **options}
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_of(server: ApiServer, body: dict[str, Any]) -> list[int]:
    reply = server.post("/v1/chat/completions", {"max_tokens": 2, **body})
    assert reply.status == 200, reply.text
    return server.fake.submits()[-1].prompt_token_ids


def script(server: ApiServer, tokenizer: Any, text: str) -> None:
    server.fake.scripted = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_template_kwargs_reach_the_template(qwen_server: ApiServer, qwen_tokenizer: Any) -> None:
    kwargs = {"enable_thinking": False}
    prompt = prompt_of(qwen_server, {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert prompt == reference(qwen_tokenizer, MESSAGES, enable_thinking=False)
    assert qwen_tokenizer.decode(prompt).endswith("<think>\n\n</think>")
    assert prompt != prompt_of(qwen_server, {"messages": MESSAGES})
    # A variable the template does not read changes nothing, as in vLLM.
    assert prompt_of(qwen_server, {"messages": MESSAGES, "chat_template_kwargs": {"unused": 1}}) == reference(
        qwen_tokenizer, MESSAGES
    )


def test_add_generation_prompt_and_continue_final_message(
    qwen_server: ApiServer, qwen_tokenizer: Any
) -> None:
    prompt = prompt_of(qwen_server, {"messages": MESSAGES, "add_generation_prompt": False})
    assert prompt == reference(qwen_tokenizer, MESSAGES, add_generation_prompt=False)
    partial = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    prompt = prompt_of(qwen_server, body)
    expected = reference(qwen_tokenizer, partial, add_generation_prompt=False, continue_final_message=True)
    assert prompt == expected and qwen_tokenizer.decode(prompt).endswith("The answer is")
    both = qwen_server.post("/v1/chat/completions", {"messages": partial, "continue_final_message": True})
    assert both.status == 400 and "add_generation_prompt" in both.json()["error"]["message"]


def test_reasoning_is_returned_apart_from_content_and_tool_calls(
    qwen_server: ApiServer, qwen_tokenizer: Any
) -> None:
    """The template opens <think> in the prompt, so the output starts in reasoning; the tool call is read
    from the content part only."""
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "</think>"}}\n</tool_call>'
    script(qwen_server, qwen_tokenizer, f"I think <tool_call> is needed.</think>\n\nCalling.{call}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    client = openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="x", max_retries=0)
    request = dict(model="tiny-llama", messages=MESSAGES, tools=tools, max_tokens=200)
    message = client.chat.completions.create(**request).choices[0].message
    assert message.model_extra["reasoning"] == "I think <tool_call> is needed."
    assert message.content == "\n\nCalling."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("f", {"x": "</think>"})
    ]

    reasoning, content, arguments = "", "", ""
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        arguments += "".join(tc.function.arguments or "" for tc in delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, json.loads(arguments), finish) == (
        "I think <tool_call> is needed.",
        "\n\nCalling.",
        {"x": "</think>"},
        "tool_calls",
    )

    # With thinking off, the template closes the block in the prompt: all content.
    script(qwen_server, qwen_tokenizer, "Plain answer.")
    body = {**request, "tools": None, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    message = client.chat.completions.create(**body).choices[0].message
    assert message.content == "Plain answer." and message.model_extra["reasoning"] is None
    qwen_server.fake.scripted = ()


def test_server_chat_template_file_and_documents(make_server: Any, tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(DOCUMENTS_TEMPLATE)
    server = make_server(ApiConfig(chat_template=str(path)))
    documents = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    prompt = prompt_of(server, {"messages": MESSAGES, "documents": documents})
    text = tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=DOCUMENTS_TEMPLATE,
        documents=documents,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompt).startswith("[DOC a] first")


def test_inline_server_template(make_server: Any, tokenizer: Any) -> None:
    server = make_server(ApiConfig(chat_template="{% for m in messages %}{{ m.content }}|{% endfor %}"))
    assert tokenizer.decode(prompt_of(server, {"messages": MESSAGES})) == "Be brief.|Hi there|"
    with pytest.raises(ValueError):
        chat_template.server_template("no/such/file.jinja")


def test_request_template_needs_trust(server: ApiServer) -> None:
    reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ messages }}"})
    assert reply.status == 400 and "--trust-request-chat-template" in reply.json()["error"]["message"]


def test_trusted_request_template_renders_as_transformers(
    qwen_server: ApiServer, qwen_tokenizer: Any
) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ flavour }}"
    )
    body = {"messages": MESSAGES, "chat_template": template, "chat_template_kwargs": {"flavour": "mint"}}
    prompt = prompt_of(qwen_server, body)
    assert prompt == reference(qwen_tokenizer, MESSAGES, chat_template=template, flavour="mint")
    broken = qwen_server.post("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{% if %}"})
    assert broken.status == 400


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # hours of loops
        "{{ 'x' * 100000000000 }}",  # 100 GB
        "{% set s = namespace(t='xxxxxxxx') %}{% for i in range(40) %}{% set s.t = s.t ~ s.t %}{% endfor %}",
    ],
)
def test_hostile_request_templates_are_bounded(
    qwen_server: ApiServer, template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_template.SANDBOX, "timeout_s", 3.0)
    start = time.monotonic()
    reply = qwen_server.post("/v1/chat/completions", {"messages": MESSAGES, "chat_template": template})
    assert reply.status == 400, reply.text
    assert time.monotonic() - start < 30  # the child's start (imports) and the 3 s limit
    ok = qwen_server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert ok.status == 200  # the server is unharmed


@pytest.mark.parametrize(
    "body, param",
    [
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": "text"}, "documents"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"},
            "tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                "tool_choice": "none",
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "none"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto, not enabled
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_refused_with_400(server: ApiServer, body: dict[str, Any], param: str) -> None:
    reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **body})
    assert reply.status == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_auto_without_the_flags_is_vllms_400(server: ApiServer) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": tools, "tool_choice": "auto"})
    assert reply.json()["error"]["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )


def _grammar_accepts(tokenizer: Any, structured: Any, text: str) -> bool:
    """Whether the worker's compiled grammar for `structured` takes `text`'s tokens and then EOS."""
    import xgrammar as xgr

    from pagedserve.common.grammars import compile_grammar

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(compile_grammar(xgr.GrammarCompiler(info), structured))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_a_forced_call_comes_after_the_thinking(qwen_server: ApiServer, qwen_tokenizer: Any) -> None:
    """vLLM's rule: with a reasoning parser, a constraint holds once the thinking ends. The prompt opens
    <think>, so a named function's arguments follow `</think>`; the grammar the worker compiles takes the
    thinking and then only the arguments' JSON. With thinking off, the JSON comes from the first token."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "messages": MESSAGES,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 50,
    }
    output = 'The user wants f {x}.</think>\n\n{"x": 1}'
    script(qwen_server, qwen_tokenizer, output)
    reply = qwen_server.post("/v1/chat/completions", body)
    message = reply.json()["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert message["reasoning"] == "The user wants f {x}." and message["content"] is None
    structured = qwen_server.fake.submits()[-1].params.structured
    assert (structured.reasoning_begin, structured.reasoning_end) == ("", "</think>")
    assert _grammar_accepts(qwen_tokenizer, structured, output)
    assert not _grammar_accepts(qwen_tokenizer, structured, '{"x": 1}')  # the thinking must end first
    assert not _grammar_accepts(qwen_tokenizer, structured, "Hmm.</think>\n\nno JSON")

    # The same holds for response_format.
    script(qwen_server, qwen_tokenizer, 'Hmm.</think>\n{"a": 2}')
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    reply = qwen_server.post("/v1/chat/completions", {"messages": MESSAGES, "response_format": fmt})
    assert json.loads(reply.json()["choices"][0]["message"]["content"]) == {"a": 2}  # after a newline
    assert qwen_server.fake.submits()[-1].params.structured.reasoning_end == "</think>"

    script(qwen_server, qwen_tokenizer, '{"x": 1}')
    no_thinking = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    message = qwen_server.post("/v1/chat/completions", no_thinking).json()["choices"][0]["message"]
    qwen_server.fake.scripted = ()
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert message["reasoning"] is None and message["content"] is None
    structured = qwen_server.fake.submits()[-1].params.structured
    assert structured.reasoning_end == "" and _grammar_accepts(qwen_tokenizer, structured, '{"x": 1}')


def test_thinking_tags_follow_the_rendered_prompt() -> None:
    from pagedserve.api.reasoning import REASONING_PARSERS

    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert qwen3.thinking_tags("<|im_start|>assistant\n<think>\n") == ("", "</think>")  # opened in the prompt
    assert qwen3.thinking_tags("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # thinking off
    assert qwen3.thinking_tags("<|im_start|>assistant\n") == ("<think>", "</think>")  # the model opens it
    assert r1.thinking_tags("<｜Assistant｜><think>\n") == ("", "</think>")
