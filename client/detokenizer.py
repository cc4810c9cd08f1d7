"""Token ids to text, a piece at a time, for streaming: incremental detokenization and stop strings.

The scheduler sees token ids only; everything that needs text (streamed deltas, stop strings, logprob token
strings) happens in the client library with the functions here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole UTF-8 character


class IncrementalDetokenizer:
    """Decodes one sequence's token ids as they arrive, returning only text that is final.

    It keeps two offsets into the ids: text up to `read_offset` has been returned, and the window from
    `prefix_offset` is what gets decoded again, so each push costs work proportional to the window, not to
    the sequence. The window starts a little before the unread ids because decoders are not concatenative:
    a byte-level token may hold half a character, and SentencePiece-style decoders drop the leading space of
    whatever comes first. Text is held back while the window ends in U+FFFD, since the next token may complete
    the character. Pushing everything and then `flush()` yields exactly `tokenizer.decode(ids,
    skip_special_tokens=...)` for tokenizers whose decode does not clean up tokenization spaces (transformers
    skips that clean-up for BPE tokenizers, Llama's included), with the same `skip_special_tokens` and
    `spaces_between_special_tokens` (the tokenizer decides what the latter does: transformers' tokenizers
    backed by `tokenizers` put no spaces between special tokens either way, as vLLM's fast detokenizer).
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset]), kept so it is decoded once

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
        )

    def push(self, token_ids: Sequence[int]) -> str:
        """Appends `token_ids` and returns the text that became final with them (often "")."""
        self.token_ids.extend(token_ids)
        text = self._decode(self.token_ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = text[len(self._prefix_text) :]
        # The ids just read become the next window's prefix: they give the decoder its context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return new_text

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD); call once at the end."""
        text = self._decode(self.token_ids[self._prefix_offset :])
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._prefix_text = ""
        return new_text


class StopChecker:
    """Finds the earliest stop string in streamed text and makes sure none of it is ever emitted.

    While streaming it holds back the end of the text when it is the start of a stop string (so at most
    len(longest stop) - 1 characters), since the next piece may complete it; everything before has been
    searched and is safe to emit.
    """

    def __init__(self, stop: Sequence[str], include_stop_str: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(stop)
        self._include = include_stop_str  # emit the stop string itself (vLLM's include_stop_str_in_output)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.stopped = False  # a stop string was found; nothing more will be emitted
        self.matched: str | None = None  # the stop string found

    def push(self, text: str) -> str:
        """Returns the part of `text` (with what was held back before it) that is safe to emit."""
        if self.stopped:
            return ""
        buf = self._pending + text
        stopped = self._stop_in(buf, final=False)
        if stopped is not None:
            return stopped
        hold = self._partial_match(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def _stop_in(self, buf: str, final: bool) -> str | None:
        """What to emit when `buf` holds a stop string that ends the text (as a search of the whole text
        would find it first); None when it holds none yet. A stop found past the start of another that the
        next text may still complete waits: the earlier one wins if it completes ("🙂Sa" before "S")."""
        hits = [(i, len(s), s) for i, s in ((buf.find(s), s) for s in self._stop) if i >= 0]
        if not hits:
            return None
        at, length, matched = min(hits)  # the earliest; of two starting there, the shorter ends first
        if not final:
            for i in range(max(0, len(buf) - self._hold), at):
                tail = buf[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                    self._pending = tail  # (the hit lies inside it: found again, or beaten, next time)
                    return buf[:i]
        self.stopped = True
        self.matched = matched
        self._pending = ""
        return buf[: at + length] if self._include else buf[:at]

    def _partial_match(self, buf: str) -> int:
        """Length of the longest end of `buf` that starts a stop string (and so must wait)."""
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def flush(self) -> str:
        """What is held back, for when the sequence ended: up to a stop string found in it (one that waited
        for a longer, earlier one that never completed), else all of it."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        stopped = self._stop_in(out, final=True)
        return out if stopped is None else stopped


class SequenceText:
    """The text of one generated sequence: incremental detokenization, then stop-string truncation."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens, spaces_between_special_tokens
        )
        self._stop = StopChecker(stop, include_stop_str) if stop else None
        # As vLLM: no stop string is looked for until min_tokens tokens are out. Their text is emitted as it
        # comes; the search starts with the text of the first token past them (nothing emitted is taken back).
        self._unchecked = min_tokens if stop else 0

    @property
    def stopped(self) -> bool:
        """A stop string was found: the text ends before it and the sequence should end."""
        return self._stop is not None and self._stop.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (None: none has)."""
        return None if self._stop is None else self._stop.matched

    def push(self, token_ids: Sequence[int]) -> str:
        early = ""
        if self._unchecked:
            n = min(self._unchecked, len(token_ids))
            self._unchecked -= n
            early, token_ids = self._detokenizer.push(token_ids[:n]), token_ids[n:]
            if not token_ids:
                return early
        text = self._detokenizer.push(token_ids)
        return early + (text if self._stop is None else self._stop.push(text))

    def finish(self) -> str:
        """The rest of the text once the sequence has ended; a stop string may still be found in it."""
        text = self._detokenizer.flush()
        if self._stop is None:
            return text
        return self._stop.push(text) + self._stop.flush()


def _byte_level_alphabet() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table.

    Bytes that are printable and not whitespace stand for themselves; the others are shifted to 256 and up,
    in byte order, so that every byte has a visible character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenStrings:
    """Per-token strings and bytes for logprobs, cached per id (the vocabulary is small next to traffic)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        added = getattr(tokenizer, "added_tokens_decoder", {})
        # Special tokens are skipped in generated text; they are not byte-level encoded either.
        self.special_ids = frozenset(i for i, t in added.items() if getattr(t, "special", False))
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # past the tokenizer's vocabulary (the model's may be larger)
            return "", b""
        alphabet = self._alphabet
        if alphabet is not None and token_id not in self.special_ids and all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
        else:
            raw = self._tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
        return raw.decode("utf-8", errors="replace"), raw

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token; a token holding part of a character shows U+FFFD in its text."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found
