"""The n-gram (prompt lookup) proposer: no model, drafts copied from the sequence itself.

For each sequence, the longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred
earlier in the sequence (prompt and output) is found, and the tokens that followed its most recent earlier
occurrence are proposed, at most `num_tokens` of them. It pays where outputs repeat their inputs (code edits,
extraction, summaries quoting the text) and costs a little host time elsewhere.

The work per sequence and step is bounded: one numpy pass per suffix length over the last `window` tokens
(`MAX_LOOKBACK`), never a Python loop over the tokens and never more than O(window * prompt_lookup_max).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker.spec.proposer import ProposeRow

MAX_LOOKBACK = 1 << 16  # tokens searched back from the end: bounds a step's work on very long sequences


def ngram_propose(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Drafts for one sequence (`tokens`: int64 [L], its last token the target's next input): the up to
    `num_tokens` tokens after the most recent earlier occurrence of its longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start before the suffix's own start: a match must be followed by a token we know.
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]; window i is tokens[i : i + n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence: the nearest context
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (the `Proposer` protocol; it keeps no state)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, lookback: int = MAX_LOOKBACK) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.lookback = lookback

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        out = []
        for row in rows:
            tail = row.token_ids[-self.lookback :]
            tokens = np.asarray(tail, dtype=np.int64)
            out.append(
                ngram_propose(tokens, row.num_tokens, self.min_n, self.max_n) if row.num_tokens else []
            )
        return out

    def free(self, seq_id: int) -> None:
        pass  # no state per sequence
