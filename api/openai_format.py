"""OpenAI's response bodies and stream chunks, for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

from pagedserve.api.generation import Choice, Usage
from pagedserve.api.model import ServedModel
from pagedserve.api.scoring import PromptEcho, echo_choice
from pagedserve.client import SequenceDelta
from pagedserve.common.messages import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; a masked-out token reports this instead


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def stop_reason(
    finish_reason: str | None, stop_string: str | None, token_ids: list[int], eos_token_id: int | None
) -> int | str | None:
    """vLLM's `stop_reason`: the stop string, or the stop token id, that ended a choice; None when the
    tokenizer's EOS or the length ended it (or it has not ended). The scheduler stops a sequence on its
    last token only when that is a stop token (stop_token_ids, or generation_config's other EOS ids, which
    vLLM also reports by id)."""
    if finish_reason != "stop":
        return None
    if stop_string is not None:
        return stop_string
    if token_ids and token_ids[-1] != eos_token_id:
        return token_ids[-1]
    return None


class ResponseFormat:
    """The shapes of one request's answer; per request, since streams keep a little state per choice."""

    object = ""
    chunk_object = ""

    def __init__(
        self,
        response_id: str,
        model: ServedModel,
        *,
        logprobs: bool,
        include_usage_field: bool = False,
        echo: PromptEcho | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo  # the prompts' echo and logprobs, and how tokens are named (api/scoring.py)
        self.strings = model.token_strings if echo is None else echo.strings
        self.logprobs = logprobs  # the request asked for logprobs
        self.created = int(time.time())
        self._usage_field = include_usage_field  # stream_options.include_usage: every chunk has "usage"
        self._started: set[int] = set()  # choices that have sent a chunk
        self.eos_token_id: int | None = getattr(getattr(model, "tokenizer", None), "eos_token_id", None)

    def stop_reason(self, finish_reason: str | None, stop_string: str | None, token_ids: list[int]) -> Any:
        return stop_reason(finish_reason, stop_string, token_ids, self.eos_token_id)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object, [self.choice(c) for c in choices])
        body["usage"] = usage.to_json()
        return body

    def chunk(self, index: int, delta: SequenceDelta) -> dict[str, Any] | None:
        """The stream chunk for one delta, or None when it carries nothing to send."""
        first = index not in self._started
        choice = self.chunk_choice(index, delta, first)
        if choice is None:
            return None
        self._started.add(index)
        body = self._envelope(self.chunk_object, [choice])
        if self._usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage.to_json()
        return body

    def choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, index: int, delta: SequenceDelta, first: bool) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per choice: characters of token text so far

    def _logprobs(
        self, index: int, token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> dict[str, Any]:
        strings = self.strings
        tokens, offsets, top = [], [], []
        offset = self._text_offsets.get(index, 0)
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            text = strings.get(token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            if token_id not in strings.special_ids:  # skipped in the text, so they take no room in it
                offset += len(text)
            if lp is None:  # the first prompt token (echo): it follows nothing
                top.append(None)
                continue
            alternatives: dict[str, float] = {}
            for alt_id, alt_lp in zip(lp.top_token_ids, lp.top_logprobs, strict=False):
                alternatives.setdefault(strings.get(alt_id)[0], _logprob(alt_lp))
            top.append(alternatives)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def choice(self, c: Choice) -> dict[str, Any]:
        text, token_ids, entries = echo_choice(
            self.echo, c.index, c.text, c.token_ids, c.logprobs, self.logprobs
        )
        logprobs = self._logprobs(c.index, token_ids, entries) if self.logprobs else None
        body = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        body["stop_reason"] = self.stop_reason(c.finish_reason, c.stop_string, c.token_ids)
        if self.echo is not None and self.echo.scored(c.index) is not None:
            body["prompt_logprobs"] = self.echo.prompt_logprobs(c.index)
        return body

    def chunk_choice(self, index: int, delta: SequenceDelta, first: bool) -> dict[str, Any] | None:
        text, token_ids, entries = echo_choice(
            self.echo, index, delta.text or "", delta.token_ids, delta.logprobs or [], self.logprobs, first
        )
        if not text and delta.finish_reason is None and not entries:
            return None
        logprobs = self._logprobs(index, token_ids, entries) if self.logprobs else None
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": self.stop_reason(delta.finish_reason, delta.stop_string, delta.token_ids),
        }


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        body = super().response(choices, usage)
        if self.echo is not None and self.echo.scored(0) is not None:  # vLLM's, on the response
            body["prompt_logprobs"] = self.echo.prompt_logprobs(0)
        return body

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.strings.get(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(raw)}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            entry = self._entry(token_id, lp.logprob)
            pairs = zip(lp.top_token_ids, lp.top_logprobs, strict=False)
            entry["top_logprobs"] = [self._entry(t, alt) for t, alt in pairs]
            content.append(entry)
        return {"content": content, "refusal": None}

    def choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": self.stop_reason(c.finish_reason, c.stop_string, c.token_ids),
        }

    def chunk_choice(self, index: int, delta: SequenceDelta, first: bool) -> dict[str, Any] | None:
        if not first and not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": delta.text or ""} if first else {}
        if delta.text and not first:
            message["content"] = delta.text
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or []) if self.logprobs else None
        return {
            "index": index,
            "delta": message,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": self.stop_reason(delta.finish_reason, delta.stop_string, delta.token_ids),
        }
