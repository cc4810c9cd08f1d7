"""The responses kept for `previous_response_id`: bounded in count, in age and in characters held.

A stored response is its whole conversation as chat messages (without the instructions, which OpenAI does
not carry over), so that a follow-up needs nothing else. It is kept at most `ttl_s`; past `max_entries`
or MAX_STORED_CHARS of conversations in all (their JSON, and MESSAGE_OVERHEAD a message), the oldest go
first. A response is found only by requests of the API key (tenant) that made it: another key's id is as
unknown as a made-up one.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_STORED_CHARS = 64 * 1024 * 1024  # the conversations' size (below) the store holds in all
MESSAGE_OVERHEAD = 256  # what a message's dict costs beyond its JSON, counted as characters


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the tenant's name ("" without API keys)
    conversation: list[dict[str, Any]]  # chat messages, this response's assistant turn last
    num_chars: int
    stored_at: float


class ResponseStore:
    """id -> StoredResponse, oldest first; the only owner of what it holds."""

    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        max_chars: int = MAX_STORED_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_chars -= entry.num_chars

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values())).stored_at < deadline:
            self._drop_oldest()

    def put(self, response_id: str, owner: str, conversation: list[dict[str, Any]]) -> bool:
        """Stores a conversation; False when it is larger than the whole store (it is not kept)."""
        # Counted as JSON plus a fixed cost per message, so many empty messages weigh what their dicts do
        num_chars = len(json.dumps(conversation, ensure_ascii=False)) + MESSAGE_OVERHEAD * len(conversation)
        if self.max_entries == 0 or num_chars > self.max_chars:
            return False
        self._expire()
        self._entries.pop(response_id, None)
        while self._entries and (
            len(self._entries) >= self.max_entries or self.num_chars + num_chars > self.max_chars
        ):
            self._drop_oldest()
        self._entries[response_id] = StoredResponse(owner, conversation, num_chars, self.clock())
        self.num_chars += num_chars
        return True

    def get(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The stored conversation (a copy of its list), or None: unknown, expired, or another owner's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return list(entry.conversation)
