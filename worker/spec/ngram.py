"""The n-gram (prompt lookup) proposer: no model, drafts copied from the sequence itself.

For each sequence, the longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred
earlier in the sequence (prompt and output) is found, and the tokens that followed its most recent earlier
occurrence are proposed, at most `num_tokens` of them. It pays where outputs repeat their inputs (code edits,
extraction, summaries quoting the text) and costs a little host time elsewhere.

The work per sequence and step is bounded and vectorised: the proposer keeps each sequence's tokens in a
numpy array (only the tokens added since the last step are converted), finds the earlier positions of the
last token in one pass over the last `lookback` tokens, and extends those candidates backwards, all at once,
at most `prompt_lookup_max - 1` times: O(lookback + candidates * prompt_lookup_max), never O(len^2).
"""

from __future__ import annotations

import numpy as np

from pagedserve.worker.spec.proposer import ProposeRow

MAX_LOOKBACK = 8192  # tokens searched back from the end: bounds a step's host work on long sequences


def ngram_propose(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Drafts for one sequence (`tokens`: [L], its last token the target's next input): the up to
    `num_tokens` tokens after the most recent earlier occurrence of its longest matching suffix."""
    length = len(tokens)
    if length < 2 or num_tokens < 1:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence of the suffix could end
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # the suffix length matched at each candidate
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        before = ends - j
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the most recent: the nearest context
    return tokens[end + 1 : end + 1 + num_tokens].tolist()


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (the `Proposer` protocol). Its only state is each
    sequence's tokens as an array, grown as they grow and dropped by `free`."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, lookback: int = MAX_LOOKBACK) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.lookback = lookback
        self._tokens: dict[int, tuple[np.ndarray, list[int]]] = {}  # seq id -> (buffer, its token list)
        self._lengths: dict[int, int] = {}  # seq id -> tokens of the buffer filled

    def _array(self, row: ProposeRow) -> np.ndarray:
        """The row's tokens as an array, converting only what was appended since the last call (a sequence's
        token list only grows; another list under the same id, or a shorter one, starts over)."""
        ids = row.token_ids
        length = len(ids)
        held = self._tokens.get(row.seq_id)
        filled = self._lengths.get(row.seq_id, 0)
        if held is None or held[1] is not ids or filled > length:
            held, filled = (np.empty(max(64, 2 * length), dtype=np.int64), ids), 0
        buffer = held[0]
        if length > len(buffer):
            buffer = np.concatenate([buffer[:filled], np.empty(2 * length - filled, dtype=np.int64)])
        buffer[filled:length] = ids[filled:length]
        self._tokens[row.seq_id] = (buffer, ids)
        self._lengths[row.seq_id] = length
        return buffer[max(0, length - self.lookback) : length]

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        return [ngram_propose(self._array(row), row.num_tokens, self.min_n, self.max_n) for row in rows]

    def free(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
