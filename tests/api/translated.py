"""What the tests of /v1/responses and /v1/messages share: a server in front of the fake scheduler whose
checkpoint has a Hermes-style chat template (tools, tool results, an open <think> in the generation
prompt), read with --tool-call-parser hermes and --reasoning-parser qwen3, and a way to script its output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.common.config import ApiConfig
from tests.api.chat_templates import TEMPLATES, checkpoint_with_template
from tests.api.harness import ApiServer

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


class ScriptedServer:
    """An ApiServer whose fake scheduler generates the text a test scripts (then EOS)."""

    def __init__(self, server: ApiServer, tokenizer: Any) -> None:
        self.server = server
        self.tokenizer = tokenizer

    def script(self, text: str) -> None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert self.tokenizer.decode(ids) == text
        self.server.fake.scripted = tuple(ids)

    def last_prompt(self) -> str:
        """The text of the prompt last submitted to the fake scheduler."""
        return self.tokenizer.decode(self.server.fake.submits()[-1].prompt_token_ids)


def scripted_server(
    tiny_model_dir: Path, folder: Path, config: ApiConfig | None = None
) -> Iterator[ScriptedServer]:
    from transformers import AutoTokenizer

    root = checkpoint_with_template(tiny_model_dir, folder / "ckpt", TEMPLATES["hermes"])
    config = config or ApiConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    server = ApiServer(str(root), config, max_model_len=2048, num_kv_blocks=1024)
    try:
        yield ScriptedServer(server, AutoTokenizer.from_pretrained(str(root)))
    finally:
        server.close()


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as Hermes-style models write it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def sse_events(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, JSON data) of each server-sent event of a stream with no [DONE]."""
    events = []
    assert text.endswith("\n\n"), text[-200:]
    for block in text.split("\n\n")[:-1]:
        name, data = None, None
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            else:
                assert field == "data", block
                data = json.loads(value)
        assert data is not None, block
        events.append((name, data))
    return events
