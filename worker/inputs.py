"""The host side of a step: the flat inputs of a batch (token ids, positions, slot mapping, block tables,
lengths), built from the sequences' block table array (worker/sequences.py) with array operations.

A step copies the rows of the block tables it needs instead of rebuilding Python lists. Per-step work is one
pass over the batch's sequences for their rows, starts and tokens, and a handful of numpy operations: no
Python loop over blocks, nor over tokens in a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedserve.worker.sequences import BlockTableArray, SeqState


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


def host_inputs(
    tables: BlockTableArray, seqs: list[SeqState], num_tokens: list[int], block_size: int
) -> HostInputs:
    """The inputs of a batch whose sequence b computes its next num_tokens[b] tokens. A pending token (one
    token, at the end of its sequence's chunk) is a 0 here: the runner's `_pending_feed` says where the
    device puts the real one."""
    starts = [s.num_computed_tokens for s in seqs]
    if max(num_tokens) == 1:
        token_ids = [s.token_ids[c] if not s.pending else 0 for s, c in zip(seqs, starts, strict=True)]
    else:
        token_ids = []
        for seq, c, n in zip(seqs, starts, num_tokens, strict=True):
            token_ids += seq.token_ids[c : c + n] if not seq.pending else [0]
    return build_inputs(
        tables,
        np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs)),
        np.array(starts, dtype=np.int64),
        np.array(num_tokens, dtype=np.int64),
        np.array(token_ids, dtype=np.int64),
        block_size,
    )
