"""POST /tokenize and /detokenize, with vLLM's paths, bodies and answers, by the served model's tokenizer.

/tokenize takes a text (`prompt`, with `add_special_tokens`, default true) or a conversation (`messages`,
rendered by the chat template exactly as /v1/chat/completions renders it, special tokens not added again)
and answers {count, max_model_len, tokens, token_strs}; `token_strs` (the tokens' pieces, as stored in the
vocabulary) only with `return_token_strs`. /detokenize takes {tokens} and answers {prompt}, the ids decoded
with their special tokens, as vLLM does. Both are bounded as generation requests are: a text by the most
characters the context could hold (ServedModel.max_prompt_chars), token ids by the model's vocabulary and
their number by its context. Unlike vLLM, which checks the API key on /v1 paths only, they need the key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pagedserve.api.chat import render_chat_request
from pagedserve.api.errors import invalid
from pagedserve.api.fields import Fields, is_int
from pagedserve.api.handlers import INLINE_PARSE_BYTES, check_model, dumps, needs_thread
from pagedserve.api.model import ServedModel
from pagedserve.api.protocol import IGNORED_FIELDS, check_fields
from pagedserve.api.request_body import parse_json
from pagedserve.api.request_fields import REFUSED_FIELDS, accept_fields
from pagedserve.api.state import STATE
from pagedserve.api.tools import parse_tools
from pagedserve.common.config import ApiConfig

TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = frozenset(
    {"model", "messages", "add_generation_prompt", "continue_final_message"}
    | {
        "add_special_tokens",
        "return_token_strs",
        "tools",
        "documents",
        "chat_template",
        "chat_template_kwargs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
# Not ignored where they do not apply: the client meant the other form (or /v1/chat/completions' decoding)
_CHAT_ONLY = "'{}' applies to a conversation: send 'messages' instead of 'prompt'"
TOKENIZE_REFUSED = {
    **REFUSED_FIELDS,
    **{name: _CHAT_ONLY.format(name) for name in TOKENIZE_CHAT_FIELDS - TOKENIZE_FIELDS - {"messages"}},
}
TOKENIZE_CHAT_REFUSED = {**REFUSED_FIELDS, "prompt": "Only one of `prompt` or `messages` should be provided."}
DETOKENIZE_REFUSED = {
    **REFUSED_FIELDS,
    "skip_special_tokens": "'skip_special_tokens' is not supported: /detokenize keeps special tokens",
    "spaces_between_special_tokens": "'spaces_between_special_tokens' is not supported by /detokenize",
}
Work = Callable[[Any, ServedModel, ApiConfig], dict[str, Any]]


def tokenize_body(body: Any, model: ServedModel, config: ApiConfig | None = None) -> dict[str, Any]:
    """The answer to a /tokenize body: the text form ({prompt}) or the chat form ({messages})."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise invalid("Only one of `prompt` or `messages` should be provided.", "prompt")
        f = check_fields(body, TOKENIZE_CHAT_FIELDS)
        tokens = _chat_tokens(f, model, config or ApiConfig())
    else:
        f = check_fields(body, TOKENIZE_FIELDS)
        tokens = _text_tokens(f, model)
    token_strs = None
    if f.boolean("return_token_strs"):
        token_strs = list(model.tokenizer.convert_ids_to_tokens(tokens))
    return {
        "count": len(tokens),
        "max_model_len": model.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }


def _text_tokens(f: Fields, model: ServedModel) -> list[int]:
    prompt = f.body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string (or give 'messages' for a conversation)", "prompt")
    if len(prompt) > model.max_prompt_chars:
        raise invalid(
            f"the prompt is over {model.max_prompt_chars} characters, more than this model's context of "
            f"{model.max_model_len} tokens can hold",
            "prompt",
            "context_length_exceeded",
        )
    add_special_tokens = f.boolean("add_special_tokens", True)
    return list(model.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def _chat_tokens(f: Fields, model: ServedModel, config: ApiConfig) -> list[int]:
    """The conversation as /v1/chat/completions feeds it to the model (api/chat.py: the same template, tools,
    documents and template controls). The rendering adds no special tokens of its own (vLLM's default)."""
    if f.boolean("add_special_tokens"):
        raise invalid("'add_special_tokens': true is not supported with 'messages'", "add_special_tokens")
    # tool_choice plays no part in the prompt: "none" keeps the tools in it without asking for a parser
    tools = parse_tools({**f.body, "tool_choice": "none"}, config)
    return render_chat_request(f.body, model, config, tools).token_ids


def detokenize_body(body: Any, model: ServedModel, config: ApiConfig | None = None) -> dict[str, Any]:
    """The answer to a /detokenize body: {"prompt": the ids decoded, special tokens included}."""
    f = check_fields(body, DETOKENIZE_FIELDS)
    tokens = f.body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > model.max_model_len:
        message = f"'tokens' must be a list of at most {model.max_model_len} token ids (the model's context)"
        raise invalid(message, "tokens")
    if not all(is_int(t) and 0 <= t < model.vocab_size for t in tokens):
        raise invalid(f"'tokens' must hold token ids in [0, {model.vocab_size})", "tokens")
    return {"prompt": model.tokenizer.decode(tokens)}


async def tokenize(request: web.Request) -> web.Response:
    return await _answer(request, tokenize_body)


async def detokenize(request: web.Request) -> web.Response:
    return await _answer(request, detokenize_body)


def _accept_fields(request: web.Request, work: Work, body: Any) -> tuple[Any, dict[str, str]]:
    if work is detokenize_body:
        return accept_fields(request, body, DETOKENIZE_FIELDS | IGNORED_FIELDS, DETOKENIZE_REFUSED)
    if isinstance(body, dict) and "messages" in body:
        return accept_fields(request, body, TOKENIZE_CHAT_FIELDS | IGNORED_FIELDS, TOKENIZE_CHAT_REFUSED)
    return accept_fields(request, body, TOKENIZE_FIELDS | IGNORED_FIELDS, TOKENIZE_REFUSED)


async def _answer(request: web.Request, work: Work) -> web.Response:
    state = request.app[STATE]
    raw = await request.read()  # aiohttp refuses bodies over client_max_size with 413
    model = await state.models.get()

    def screened() -> tuple[Any, dict[str, str]]:
        body, headers = _accept_fields(request, work, parse_json(raw))
        check_model(body, model)
        return body, headers

    def answered() -> tuple[Any, dict[str, str]]:
        body, headers = screened()
        return work(body, model, state.config), headers

    loop = asyncio.get_running_loop()
    if len(raw) > INLINE_PARSE_BYTES:  # a long text or conversation: off the event loop (handlers.py)
        answer, headers = await loop.run_in_executor(state.tokenizer_pool, answered)
    else:
        body, headers = screened()
        if needs_thread(body):  # a request's own template waits for a child process
            answer = await loop.run_in_executor(state.tokenizer_pool, work, body, model, state.config)
        else:
            answer = work(body, model, state.config)
    return web.Response(text=dumps(answer), content_type="application/json", headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
