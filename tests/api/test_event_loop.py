"""Tokenizing a big prompt does not block the api's event loop (issue 20: a 7.9 MB prompt froze every
client for 8.8 s): a big body is parsed in the tokenizer thread (a fast tokenizer releases the GIL while it
encodes), and small requests, parsed on the loop, do not queue behind it."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from pagedserve.api.state import STATE
from tests.api.harness import ApiServer, wait_until


class WatchedTokenizer:
    """A tokenizer that says when an encode of over a million characters starts and ends; everything else
    is the real one's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.started = threading.Event()
        self.finished = threading.Event()

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        big = sum(map(len, [texts] if isinstance(texts, str) else texts)) > 1_000_000
        if big:
            self.started.set()
        try:
            return self._tokenizer(texts, **kwargs)
        finally:
            if big:
                self.finished.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_health_and_small_requests_answer_while_a_big_prompt_tokenizes(make_server: Any) -> None:
    server: ApiServer = make_server(max_model_len=200_000, num_kv_blocks=20_000)  # 12.8M characters fit
    assert server.post("/v1/completions", {"prompt": "warm", "max_tokens": 1}).status == 200
    models = server._runner.app[STATE].models
    watched = WatchedTokenizer(models.loaded.tokenizer)  # type: ignore[union-attr]
    models._model = dataclasses.replace(models.loaded, tokenizer=watched)  # type: ignore[arg-type]

    big: list[Any] = []
    sender = threading.Thread(
        target=lambda: big.append(server.post("/v1/completions", {"prompt": "hello world " * 300_000}))
    )
    sender.start()
    assert watched.started.wait(30)
    health = server.get("/health")
    small = server.post("/v1/completions", {"prompt": "a small one", "max_tokens": 2})
    answered_during_encode = not watched.finished.is_set()
    sender.join(60)
    assert health.status == 200 and small.status == 200
    assert answered_during_encode  # the loop served both while the 3.6 MB prompt was being tokenized
    assert big[0].status == 400 and big[0].json()["error"]["code"] == "context_length_exceeded"
    assert wait_until(lambda: server.get("/health").status == 200)
