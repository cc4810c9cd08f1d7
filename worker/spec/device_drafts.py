"""Drafts that stay on the device: a proposer that drafts on the GPU (the draft model) hands the target its
tokens without a host sync between proposing and verifying. The host knows how many drafts each row has
(that is decided before the draft model runs), which is all it needs to lay out the verification step; the
draft tokens reach the target's token ids on the device (`feed`), and their values come to the host with
the step's results (`host`), for acceptance and the proposer's own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.worker.staging import stage


@dataclass
class DeviceDrafts:
    """Per row of a propose call, its drafts: their count on the host, their ids on the device."""

    counts: list[int]  # [R] drafts of each row (0: none)
    tokens: torch.Tensor  # [R, K] int64 on the device: row i's drafts in its first counts[i] columns
    _copy: torch.Tensor | None = None  # [R, K] their copy on the host (pinned on CUDA), once started
    _event: torch.cuda.Event | None = None  # CUDA: the copy is done
    _lists: list[list[int]] | None = None

    def start_copy(self) -> DeviceDrafts:
        """Queues the copy of the tokens to the host behind the work that computes them; no wait."""
        if self.tokens.device.type == "cuda":
            self._copy = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._copy.copy_(self.tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._copy = self.tokens
        return self

    def host(self) -> list[list[int]]:
        """Each row's drafts on the host; waits for their copy (done once the step's results are in)."""
        if self._lists is None:
            if self._copy is None:
                self.start_copy()
            if self._event is not None:
                self._event.synchronize()
            assert self._copy is not None
            table = self._copy.tolist()
            self._lists = [table[i][:n] for i, n in enumerate(self.counts)]
        return self._lists

    def feed(self, rows: list[int], firsts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat token indices, draft ids) on the device that put the drafts of call rows `rows` into a
        batch whose row rows[i]'s drafts start at flat index firsts[i]."""
        counts = np.array([self.counts[r] for r in rows], dtype=np.int64)
        total = int(counts.sum())
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        index = np.concatenate(
            [np.repeat(firsts, counts) + offsets, np.repeat(np.array(rows, np.int64), counts), offsets]
        )
        flat, row, col = stage([index], self.tokens.device)[0].view(3, total)
        return flat, self.tokens[row, col]
