"""worker/inputs.py: a batch's flat inputs built with array operations from the block-table rows that
worker/sequences.py keeps per sequence, against a token-by-token reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedserve.worker.inputs import build_inputs
from pagedserve.worker.sequences import BlockTableArray

BLOCK_SIZE = 16


def _reference(tables: list[list[int]], starts: list[int], num_tokens: list[int]) -> dict[str, list[int]]:
    positions, slots = [], []
    for table, start, n in zip(tables, starts, num_tokens, strict=True):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return {"positions": positions, "slot_mapping": slots}


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_build_inputs_matches_token_by_token_reference(seed: int, decode_only: bool) -> None:
    rng = random.Random(seed)
    array = BlockTableArray(max_blocks_per_seq=40, initial_rows=2)  # grows while sequences are added
    free = list(range(1000))
    rng.shuffle(free)
    tables, rows, starts, num_tokens = [], [], [], []
    for _ in range(rng.randint(1, 9)):
        start = rng.choice([0, 1, 15, 16, 17, rng.randrange(0, 500)])
        n = 1 if decode_only else rng.choice([1, 2, 16, 33, rng.randrange(1, 100)])
        table = [free.pop() for _ in range(-(-(start + n) // BLOCK_SIZE))]
        # Rows are written in pieces, as plans add blocks, with a freed row in between.
        row = array.add(table[:1])
        array.free(array.add([free.pop()]))
        array.extend(row, table[1:])
        tables.append(table)
        rows.append(row)
        starts.append(start)
        num_tokens.append(n)
    token_ids = np.array([rng.randrange(50_000) for _ in range(sum(num_tokens))], dtype=np.int64)
    got = build_inputs(array, np.array(rows), np.array(starts), np.array(num_tokens), token_ids, BLOCK_SIZE)
    want = _reference(tables, starts, num_tokens)
    assert got.positions.tolist() == want["positions"]
    assert got.slot_mapping.tolist() == want["slot_mapping"]
    assert got.token_ids is token_ids
    assert got.seq_lens.tolist() == [s + n for s, n in zip(starts, num_tokens, strict=True)]
    assert got.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(num_tokens)]).tolist()
    assert got.max_query_len == max(num_tokens) and got.max_seq_len == max(got.seq_lens)
    assert got.decode_only == decode_only
    leading = 0
    while leading < len(num_tokens) and num_tokens[leading] == 1:
        leading += 1
    assert got.num_decode_seqs == leading
    for b, table in enumerate(tables):
        assert got.block_tables[b, : len(table)].tolist() == table
    assert got.block_tables.shape == (len(tables), -(-got.max_seq_len // BLOCK_SIZE))


def test_block_table_rows_follow_set_extend_copy_and_free() -> None:
    array = BlockTableArray(max_blocks_per_seq=4, initial_rows=1)
    a = array.add([5, 6])
    b = array.copy_row(a)  # a fork: same blocks, own row
    array.extend(b, [9])
    array.set(a, [7])  # a swap-in: a new table
    assert a != b
    assert array.tables[a, : array.num_blocks[a]].tolist() == [7]
    assert array.tables[b, : array.num_blocks[b]].tolist() == [5, 6, 9]
    array.free(a)
    assert array.add([1]) == a  # a freed row is reused
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        array.extend(b, [1, 2])
