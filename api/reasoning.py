"""Reasoning parsers (--reasoning-parser, vLLM's names): a `<think>...</think>` part of the output is
returned as `reasoning` (vLLM's field; it was `reasoning_content` until vLLM renamed it in 2025), apart
from `content`.

`deepseek_r1`: the output starts in reasoning (DeepSeek-R1's template opens `<think>` in the prompt; a
`<think>` the model writes itself is dropped), up to `</think>`; an output without `</think>` is all
reasoning, as in vLLM. `qwen3`: the output is reasoning when the model opens it with `<think>`, or when the
prompt ends with an open `<think>` (Qwen3 thinking-only checkpoints, templates that force thinking); with
`enable_thinking` off Qwen3's template closes the block in the prompt, and the output is all content.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.api.tool_parsers.base import held_prefix

START = "<think>"
END = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass
class ReasoningParser:
    """Splits one choice's text, whole or as it streams, into reasoning and content."""

    name: ClassVar[str] = ""
    prompt_opens_reasoning: bool = False  # the rendered prompt ends inside an open <think>
    text: str = ""
    _state: str = "start"  # start (before the first non-space), reasoning, content
    _sent: int = 0  # characters of `text` already split
    _done: list[str] = field(default_factory=list)

    def _starts_in_reasoning(self, opened: bool) -> bool:
        raise NotImplementedError

    @classmethod
    def thinking_tags(cls, prompt_text: str) -> tuple[str, str] | None:
        """How the output's thinking is marked, for structured output to hold off until it ends (as vLLM):
        (what opens it, what closes it), or None when the rendered prompt leaves no thinking to do."""
        raise NotImplementedError

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self.text += delta
        out = ReasoningDelta()
        while True:
            rest = self.text[self._sent :]
            if self._state == "start":
                stripped = rest.lstrip()
                if not final and (not stripped or (START.startswith(stripped) and stripped != START)):
                    return out  # may still become <think>
                opened = stripped.startswith(START)
                if opened:
                    self._sent += len(rest) - len(stripped) + len(START)
                reasoning = self._starts_in_reasoning(opened)
                self._state = "reasoning" if reasoning else "content"
            elif self._state == "reasoning":
                end = rest.find(END)
                if end >= 0:
                    out.reasoning += rest[:end]
                    self._sent += end + len(END)
                    self._state = "content"
                    continue
                keep = 0 if final else held_prefix(rest, END)
                out.reasoning += rest[: len(rest) - keep]
                self._sent += len(rest) - keep
                return out
            else:
                out.content += rest
                self._sent += len(rest)
                return out

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A whole text's reasoning and content, each None when empty."""
        out = self.feed(text, final=True)
        return out.reasoning or None, out.content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def _starts_in_reasoning(self, opened: bool) -> bool:
        return True

    @classmethod
    def thinking_tags(cls, prompt_text: str) -> tuple[str, str] | None:
        return ("", END)  # the template opens <think> in the prompt


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def _starts_in_reasoning(self, opened: bool) -> bool:
        return opened or self.prompt_opens_reasoning

    @classmethod
    def thinking_tags(cls, prompt_text: str) -> tuple[str, str] | None:
        if prompt_opens_reasoning(prompt_text):
            return ("", END)
        if prompt_text.rstrip().endswith(END):
            return None  # enable_thinking off: the template closed an empty block
        return (START, END)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> block open for the model to continue."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)
