"""A request whose own token rules clash with its grammar, over HTTP through the real api, scheduler and CPU
worker: its `allowed_token_ids` exclude every token its regex allows, so the worker finds its row with no
token to draw (worker/masked_rows.py) and the client gets a 400 with an OpenAI-style error body, streamed or
not; a valid request sent beside it completes, and the server serves on."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest
from transformers import AutoTokenizer

from tests.e2e.processes import start_server

pytestmark = pytest.mark.e2e

REGEX = "[0-9]{3}"


@pytest.fixture(scope="module")
def real_server(tiny_model_dir, tmp_path_factory):
    srv = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("logs"), num_kv_blocks=128, max_num_seqs=8,
        max_num_batched_tokens=64, max_model_len=256, dtype="float32",
    )  # fmt: skip
    yield srv
    srv.stop()


def _letters(model_dir) -> list[int]:
    """Tokens that are letters only: the regex of digits allows none of them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip().isalpha()][:16]


def _post(server, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _clash(model_dir, **extra) -> dict:
    return {
        "model": "tiny-llama", "prompt": "Number:", "max_tokens": 10, "temperature": 1.0,
        "structured_outputs": {"regex": REGEX}, "allowed_token_ids": _letters(model_dir), **extra,
    }  # fmt: skip


def test_the_clash_is_a_400_and_its_batch_mate_completes(real_server, tiny_model_dir):
    valid = {
        "model": "tiny-llama",
        "prompt": "Number:",
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 3,
    }
    valid["structured_outputs"] = {"regex": REGEX}
    replies: dict[str, tuple[int, bytes]] = {}
    threads = [
        threading.Thread(target=lambda k=k, b=b: replies.__setitem__(k, _post(real_server, b)))
        for k, b in (("clash", _clash(tiny_model_dir)), ("valid", valid))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    status, body = replies["clash"]
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "allowed_token_ids" in error["message"]
    status, body = replies["valid"]
    assert status == 200, body
    assert re.fullmatch(REGEX, json.loads(body)["choices"][0]["text"])


def test_a_streamed_clash_ends_with_an_error_event(real_server, tiny_model_dir):
    status, body = _post(real_server, _clash(tiny_model_dir, stream=True))
    events = [line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    if status == 400:  # (the error came before the stream's headers)
        errors = [json.loads(body)["error"]]
    assert len(errors) == 1 and errors[0]["type"] == "invalid_request_error", body
    assert not any(
        json.loads(e).get("choices", [{}])[0].get("text") for e in events if e != "[DONE]" and "choices" in e
    )
    # the server serves on
    status, body = _post(real_server, {"model": "tiny-llama", "prompt": "a", "max_tokens": 2})
    assert status == 200, body
