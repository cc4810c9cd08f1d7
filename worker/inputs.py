"""The host side of a step: every live sequence's block table in one numpy array, and the flat inputs of a
batch (token ids, positions, slot mapping, block tables, lengths) built from it with array operations.

A sequence owns one row of `BlockTableArray` from the moment the worker learns of it until it is freed; the
plan's changes (new blocks, a new table after a swap-in, clones and forks) edit that row in place, so a step
copies the rows it needs instead of rebuilding Python lists. Per-step work is a handful of numpy operations
over the batch: no Python loop over tokens or over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class BlockTableArray:
    """Rows of block ids, `[num_rows, max_blocks_per_seq]` int32, one per live sequence."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int32)  # [num_rows] blocks held by each row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def _grow(self) -> None:
        old = self.tables.shape[0]
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A new row holding `block_ids`; returns its index."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.set(row, block_ids)
        return row

    def set(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self._check_width(n)
        self.tables[row, :n] = block_ids
        self.num_blocks[row] = n

    def extend(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self._check_width(end)
        self.tables[row, start:end] = block_ids
        self.num_blocks[row] = end

    def copy_row(self, src: int) -> int:
        """A new row with the same blocks as `src` (a clone or fork child); returns its index."""
        row = self.add([])
        n = int(self.num_blocks[src])
        self.tables[row, :n] = self.tables[src, :n]
        self.num_blocks[row] = n
        return row

    def free(self, row: int) -> None:
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def _check_width(self, n: int) -> None:
        if n > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {n} blocks exceeds max_model_len ({self.max_blocks_per_seq})")


@dataclass
class HostInputs:
    """A batch's flat inputs on the host; `T` tokens of `B` sequences."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32, context length after this step
    query_start_loc: np.ndarray  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int  # leading sequences with one token each: the decodes, which plans put first

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def build_inputs(
    tables: BlockTableArray,
    rows: np.ndarray,  # [B] row of each sequence in `tables`
    starts: np.ndarray,  # [B] num_computed_tokens of each sequence before this step
    num_tokens: np.ndarray,  # [B] tokens scheduled for each sequence
    token_ids: np.ndarray,  # [T] the scheduled tokens, concatenated in batch order
    block_size: int,
) -> HostInputs:
    """Positions, slots and block tables of a batch whose sequence b computes tokens starts[b] ..
    starts[b] + num_tokens[b] - 1."""
    seq_lens = (starts + num_tokens).astype(np.int32)
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=query_start_loc[1:])
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    block_tables = tables.tables[rows, :max_blocks]  # a copy: fancy indexing
    num_scheduled = int(query_start_loc[-1])
    if num_scheduled == len(rows):  # every chunk is one token: the common decode step
        seq_index = np.arange(len(rows))
        positions = starts.astype(np.int64)
        num_decode_seqs = len(rows)
    else:
        num_decode_seqs = int(np.argmax(num_tokens != 1))
        seq_index = np.repeat(np.arange(len(rows)), num_tokens)  # [T]
        # Token j of sequence b sits at position starts[b] + (j - query_start_loc[b]).
        positions = np.arange(num_scheduled, dtype=np.int64) + (starts - query_start_loc[:-1])[seq_index]
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    return HostInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=int(num_tokens.max()),
        max_seq_len=max_seq_len,
        num_decode_seqs=num_decode_seqs,
    )
