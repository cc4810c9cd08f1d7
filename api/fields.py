"""Typed, bounded access to a request body's fields: every value the api forwards has a finite range.

The bounds follow vLLM's where it has them (penalties, logprobs, lengths) and are otherwise generous
enough for any real client while keeping one request's cost small next to the server's.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from pagedserve.api.errors import invalid

MAX_INT = 2**31 - 1  # bounds integers we forward, so they always fit the wire format
MAX_N = 128  # sequences per prompt, as the scheduler allows
MAX_STOP_STRINGS = 16  # vLLM takes any number; each costs a scan of every delta
MAX_STOP_CHARS = 1024  # the detokenizer holds back up to the longest stop string's length
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 1024
MAX_NAME_CHARS = 256  # a chat message's `name`
MAX_MESSAGES = 4096  # chat messages in one request (their text is bounded by the prompt's length)
MAX_LENGTH_PENALTY = 100.0  # |length_penalty|; beam scores raise lengths to this power

_show = reprlib.Repr()
_show.maxlevel, _show.maxstring, _show.maxother, _show.maxlong = 2, 40, 40, 40
_show.maxlist = _show.maxdict = 4


def show(value: Any) -> str:
    """A short repr for error messages: bounded in length and depth, whatever the client sent."""
    return _show.repr(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Typed access to a JSON object's fields; a wrong type or an out-of-range value is a 400 naming it."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def integer(
        self, name: str, default: int | None = None, lo: int = -MAX_INT, hi: int = MAX_INT
    ) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not is_int(value):
            raise invalid(f"'{name}' must be an integer, got {show(value)}", name)
        if not lo <= value <= hi:
            raise invalid(f"'{name}' must be between {lo} and {hi}, got {show(value)}", name)
        return value

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        """A finite number in [lo, hi] (the body's parser already refused NaN and Infinity)."""
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise invalid(f"'{name}' must be a number, got {show(value)}", name)
        number = float(value) if not isinstance(value, int) or abs(value) < 2**53 else math.inf
        if not (math.isfinite(number) and lo <= number <= hi):
            raise invalid(f"'{name}' must be between {lo} and {hi}, got {show(value)}", name)
        return number

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean, got {show(value)}", name)
        return value

    def neutral(self, name: str, *allowed: Any) -> None:
        """Refuses any value but the ones that leave the output unchanged."""
        value = self.body.get(name)
        if value is not None and not any(type(value) is not bool and value == a for a in allowed):
            raise invalid(f"'{name}' is not supported (only {allowed[0]!r}), got {show(value)}", name)

    def string(self, name: str, max_chars: int) -> str:
        """A string field that must not be empty when given; "" when absent."""
        value = self.body.get(name)
        if value is None:
            return ""
        if not isinstance(value, str) or not value or len(value) > max_chars:
            raise invalid(f"'{name}' must be a non-empty string of at most {max_chars} characters", name)
        return value

    def stop_strings(self) -> tuple[str, ...]:
        value = self.body.get("stop")
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
        ):
            raise invalid(
                f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
                f"each at most {MAX_STOP_CHARS} characters",
                "stop",
            )
        return tuple(stops)

    def token_ids(self, name: str, vocab_size: int, max_count: int = MAX_STOP_TOKEN_IDS) -> tuple[int, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        if (
            not isinstance(value, list)
            or len(value) > max_count
            or not all(is_int(t) and 0 <= t < vocab_size for t in value)
        ):
            message = f"'{name}' must be a list of at most {max_count} token ids in [0, {vocab_size})"
            raise invalid(message, name)
        return tuple(value)
