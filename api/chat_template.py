"""Chat templates: the server's (--chat-template), a request's own (`chat_template`, only with
--trust-request-chat-template), and `chat_template_kwargs`; rendering through transformers.

The server's template and the tokenizer's are the operator's, trusted, and rendered in-process by
`tokenizer.apply_chat_template`, which runs them in jinja's ImmutableSandboxedEnvironment. A request's
template is untrusted: the sandbox stops it from reaching Python internals, but not from looping for hours
(nested `range` loops) or allocating without bound (`'x' * 10**10`). So it is rendered by the same
transformers function in a child process (SandboxRenderer) whose address space is capped
(RENDER_MEMORY_BYTES beyond what its imports use) and which is killed when it runs past RENDER_TIMEOUT_S;
either is a 400. The template's text is bounded (MAX_TEMPLATE_CHARS), and its output by the prompt's limit.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.pool
import os
import threading
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from pagedserve.api.errors import invalid, unavailable
from pagedserve.api.fields import show

MAX_TEMPLATE_CHARS = 256 * 1024
MAX_TEMPLATE_KWARGS = 64
RENDER_TIMEOUT_S = 5.0  # a request's own template, rendered in the child process
RENDER_MEMORY_BYTES = 1 << 30  # the child's address space beyond its imports
STARTUP_TIMEOUT_S = 120.0  # the child's start: a fresh interpreter importing transformers' renderer
# Names the renderer sets itself (or transformers' apply_chat_template takes), so not template kwargs.
CALL_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "raise_exception",
        "strftime_now",
    }
)
# What the template reads as given by the server: the special tokens (the tokenizer's special_tokens_map,
# which apply_chat_template lets kwargs override) and jinja's own globals. A kwarg of one of these names
# would put text of the request's choosing where the template puts a special token (`bos_token`).
SPECIAL_TOKEN_NAMES = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "extra_special_tokens",
    }
)
JINJA_GLOBALS = frozenset({"range", "dict", "lipsum", "cycler", "joiner", "namespace"})
RESERVED_KWARGS = CALL_KWARGS | SPECIAL_TOKEN_NAMES | JINJA_GLOBALS


@lru_cache(maxsize=4)
def server_template(spec: str) -> str | None:
    """--chat-template as a template: a file's text, or `spec` itself when it holds jinja; None when empty.
    Raises ValueError for a path that does not exist or a template that does not parse."""
    if not spec:
        return None
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in spec or "{%" in spec:
        template = spec
    else:
        raise ValueError(f"--chat-template: {spec!r} is neither a file nor a jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: {e}") from None
    return template


def template_kwargs(value: Any, special_tokens: Iterable[str] = ()) -> dict[str, Any]:
    """`chat_template_kwargs`: variables for the template (Qwen3's enable_thinking, say). A variable the
    template does not use changes nothing, as in vLLM; one the renderer sets itself, a special token's name
    (RESERVED_KWARGS, and `special_tokens`: the tokenizer's own names) or a jinja global is a 400."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        message = f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} entries"
        raise invalid(message, "chat_template_kwargs")
    reserved = sorted(set(value) & (RESERVED_KWARGS | set(special_tokens)))
    if reserved:
        message = f"'chat_template_kwargs' may not set {show(reserved)}: use the request's own fields"
        raise invalid(message, "chat_template_kwargs")
    return dict(value)


def request_template(value: Any, trusted: bool) -> str | None:
    """A request's own `chat_template`."""
    if value is None:
        return None
    if not trusted:
        raise invalid(
            "'chat_template' is not accepted: the server was not started with --trust-request-chat-template",
            "chat_template",
        )
    if not isinstance(value, str) or not value or len(value) > MAX_TEMPLATE_CHARS:
        message = f"'chat_template' must be a non-empty string of at most {MAX_TEMPLATE_CHARS} characters"
        raise invalid(message, "chat_template")
    return value


def _limit_memory(budget: int) -> None:
    """The child's initializer: transformers' renderer imported first, then the address space capped."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401

    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + budget, used + budget))


def _ready() -> bool:
    return True


def _render(template: str, messages: list[Any], options: dict[str, Any]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, **options)
    except MemoryError:
        raise ValueError("the chat template ran out of memory") from None
    except RecursionError:
        raise ValueError("the chat template recursed too deeply") from None
    except Exception as e:  # any error is the template's: sent back as text, never as a foreign object
        raise ValueError(f"{type(e).__name__}: {str(e)[:300]}") from None
    return str(rendered[0])


class SandboxRenderer:
    """Renders untrusted chat templates in a child process, one at a time, each within RENDER_TIMEOUT_S and
    RENDER_MEMORY_BYTES; a child that overruns is killed and the next render starts a new one."""

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S, memory_bytes: int = RENDER_MEMORY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._pool: multiprocessing.pool.Pool | None = None
        self._lock = threading.Lock()

    def render(self, template: str, messages: list[Any], options: dict[str, Any]) -> str:
        """The rendered text, as transformers' apply_chat_template(tokenize=False) gives it for the same
        arguments (`options` holds the special tokens and template kwargs too). Raises ApiError 400."""
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")  # no copy of the api's threads and sockets
                self._pool = context.Pool(1, _limit_memory, (self.memory_bytes,))
                try:  # the child's start (imports) is not the template's time
                    self._pool.apply_async(_ready).get(STARTUP_TIMEOUT_S)
                except multiprocessing.TimeoutError:
                    self._pool.terminate()
                    self._pool = None
                    raise unavailable("the chat template sandbox did not start") from None
            pending = self._pool.apply_async(_render, (template, messages, options))
            try:
                return pending.get(self.timeout_s)
            except multiprocessing.TimeoutError:
                self._pool.terminate()
                self._pool = None
                message = f"the chat template took longer than {self.timeout_s} s to render"
                raise invalid(message, "chat_template") from None
            except ValueError as e:
                raise invalid(f"the chat template failed: {str(e)[:300]}", "chat_template") from None

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None


SANDBOX = SandboxRenderer()  # started on the first request that brings its own template
atexit.register(SANDBOX.close)  # before the interpreter tears down what the pool's finalizer needs
