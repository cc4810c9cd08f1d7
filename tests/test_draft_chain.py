"""The draft chain (worker/spec/draft_graphs.py) run eagerly on the CPU: a steady-state call drafts what the
step-by-step path drafts and writes the same KV into the draft's pool, over uneven lengths whose drafts
cross block boundaries, for several k and batches of 1 to 5 rows (padded to the sizes 1, 2, 4, 8 as the
graphs pad them); the draft's bookkeeping ends as the step-by-step path leaves it; every other call takes the
step-by-step path. Its per-step inputs equal `build_inputs`' for the same rows. Triton kernels under
TRITON_INTERPRET=1: the KV write that skips the padding rows' slot -1 is the one the GPU runs."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import WorkerConfig
from common.speculative import SpeculativeConfig
from scripts.make_model import make_model
from tests.test_draft_model import Reference
from worker.cuda_graphs import DecodeGraphs
from worker.inputs import build_inputs
from worker.sequences import BlockTableArray
from worker.spec.device_drafts import DeviceDrafts
from worker.spec.draft_graphs import DraftChain, chain_inputs
from worker.spec.draft_model import DraftModelProposer
from worker.spec.proposer import ProposeRow

BLOCK_SIZE = 4  # k = 4 drafts always cross a block boundary; k = 1 and 2 when the length falls right
MAX_BATCH = 8  # chains of 1, 2, 4 and 8 rows: batches of 3, 5 run with padding rows


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("chain") / "tiny-draft", preset="tiny-draft", seed=1)


def _proposer(target: Path, draft: Path, k: int, chained: bool) -> DraftModelProposer:
    worker = WorkerConfig(
        model=str(target), device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=128,
        max_num_seqs=MAX_BATCH, swap_space=0, attention_backend="triton",
    )  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(draft))
    proposer = DraftModelProposer(worker, spec, "cpu", torch.float32)
    proposer.allocate_kv(160)
    assert proposer.graphs is None and proposer.chain is None  # the CPU: the step-by-step path
    if chained:
        graphs = DecodeGraphs(
            proposer.model, proposer.kv.layers, MAX_BATCH, proposer.max_blocks_per_seq,  # type: ignore[union-attr]
            proposer.max_model_len, torch.device("cpu"), show_progress=False, capture=False,
        )  # fmt: skip
        proposer.chain = DraftChain(graphs, BLOCK_SIZE, k, capture=False)
    return proposer


def _assert_same_state(steps: DraftModelProposer, chained: DraftModelProposer) -> None:
    """The draft's records, the last call's unsettled drafts and the KV pools of both proposers agree."""
    assert steps.pool is not None and chained.pool is not None
    chained.pool.check_invariants()
    assert steps.pool.seqs.keys() == chained.pool.seqs.keys()
    for seq_id, seq in steps.pool.seqs.items():
        other = chained.pool.seqs[seq_id]
        assert (other.row, other.block_ids, other.computed, other.num_truth) == (
            seq.row, seq.block_ids, seq.computed, seq.num_truth,
        ), seq_id  # fmt: skip
    assert steps.num_kv_only_replays == chained.num_kv_only_replays
    assert (steps._unsettled is None) == (chained._unsettled is None)
    if steps._unsettled is not None and chained._unsettled is not None:
        assert [(i, s, r) for i, _, s, r in steps._unsettled[1]] == [
            (i, s, r) for i, _, s, r in chained._unsettled[1]
        ]
    assert steps.kv is not None and chained.kv is not None
    for (k_a, v_a), (k_b, v_b) in zip(steps.kv.layers, chained.kv.layers, strict=True):
        torch.testing.assert_close(k_b, k_a)
        torch.testing.assert_close(v_b, v_a)


def _propose(proposer: DraftModelProposer, rows: list[ProposeRow]) -> tuple[DeviceDrafts, list[list[int]]]:
    with torch.inference_mode():
        drafts = proposer.propose_on_device(rows)
    return drafts, drafts.host()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_eager_chain_drafts_and_writes_what_the_step_by_step_path_does(
    tiny_model_dir: Path, draft_dir: Path, k: int
) -> None:
    steps, chained = (
        _proposer(tiny_model_dir, draft_dir, k, False),
        _proposer(tiny_model_dir, draft_dir, k, True),
    )
    rng = random.Random(k)
    crossed = False
    for batch in range(1, 6):
        seqs = {
            100 * batch + i: [rng.randrange(4096) for _ in range(rng.randrange(2, 40))] for i in range(batch)
        }
        for call in range(3):  # a catch-up (step by step), then two steady-state calls (chained)
            rows = [ProposeRow(seq_id, list(tokens), k) for seq_id, tokens in seqs.items()]
            before = chained.num_chain_replays
            (a, drafts), (b, chain_drafts) = _propose(steps, rows), _propose(chained, rows)
            assert chain_drafts == drafts and all(len(d) == k for d in drafts)
            assert b.tokens.shape == a.tokens.shape and b.counts == a.counts
            assert chained.num_chain_replays == before + (call > 0)
            _assert_same_state(steps, chained)
            if call:
                crossed |= any(
                    (len(t) - 1) // BLOCK_SIZE != (len(t) + k - 1) // BLOCK_SIZE for t in seqs.values()
                )
            for seq_id, draft in zip(seqs, drafts, strict=True):  # the target accepts some, adds its own
                accepted = rng.randrange(k + 1)
                bonus = rng.choice([t for t in range(50) if accepted == k or t != draft[accepted]])
                seqs[seq_id] += draft[:accepted] + [bonus]
        for seq_id in seqs:
            steps.free(seq_id)
            chained.free(seq_id)
    assert crossed
    assert chained.chain is not None and chained.chain.num_replays == chained.num_chain_replays == 10


def test_calls_off_the_steady_state_take_the_step_by_step_path(tiny_model_dir: Path, draft_dir: Path) -> None:
    k = 4
    proposer, ref = _proposer(tiny_model_dir, draft_dir, k, True), Reference(draft_dir)
    rng = random.Random(7)
    seqs = {i: [rng.randrange(4096) for _ in range(rng.randrange(3, 30))] for i in range(10)}

    def call(ids: list[int], nums: dict[int, int] | None = None) -> int:
        before = proposer.num_chain_replays
        rows = [ProposeRow(i, list(seqs[i]), (nums or {}).get(i, k)) for i in ids]
        drafts = proposer.propose(rows)
        for row, draft in zip(rows, drafts, strict=True):
            assert draft == ref.greedy(list(row.token_ids), row.num_tokens)
            seqs[row.seq_id] += draft + [rng.randrange(4096)]  # every draft accepted, and the bonus
        return proposer.num_chain_replays - before

    assert call([0, 1, 2]) == 0  # catching up
    assert call([0, 1, 2]) == 1  # the steady state
    assert call([0, 1, 2, 3]) == 0  # a row catching up beside them
    assert call([0, 1, 2, 3], {1: 2}) == 0  # fewer drafts for one row
    assert call([0, 1, 2, 3]) == 1
    assert call(list(range(10))) == 0  # catch-ups
    assert call(list(range(10))) == 0  # 10 rows: past the largest chain (8)
    assert call(list(range(8))) == 1
    assert proposer.pool is not None
    proposer.pool.check_invariants()


def test_chain_inputs_are_build_inputs_per_step_and_padding_writes_nothing() -> None:
    rng = np.random.default_rng(0)
    tables = BlockTableArray(16, initial_rows=8)
    rows = [tables.add(rng.permutation(64)[: rng.integers(4, 16)].tolist()) for _ in range(5)]
    held = tables.num_blocks[rows].astype(np.int64)
    k = 4
    lengths = np.array([rng.integers(1, n * BLOCK_SIZE - k + 1) for n in held], dtype=np.int64)
    width = int(held.max())
    padded = 8  # three padding rows after the five
    lens = torch.zeros(padded, dtype=torch.int64)
    lens[:5] = torch.from_numpy(lengths)
    block_tables = torch.zeros(padded, width, dtype=torch.int32)
    block_tables[:5] = torch.from_numpy(tables.tables[rows, :width])
    steps = torch.arange(k + 1).unsqueeze(1)
    positions, slots, seq_lens = chain_inputs(lens, block_tables, steps, BLOCK_SIZE)
    for j in range(k + 1):
        one = np.ones(5, dtype=np.int64)
        want = build_inputs(tables, np.array(rows), lengths - 1 + j, one, 0 * one, BLOCK_SIZE)
        assert positions[j, :5].tolist() == want.positions.tolist()
        assert slots[j, :5].tolist() == want.slot_mapping.tolist()
        assert seq_lens[j, :5].tolist() == want.seq_lens.tolist()
        assert positions[j, 5:].tolist() == [0] * 3 and seq_lens[j, 5:].tolist() == [1] * 3
        assert slots[j, 5:].tolist() == [-1] * 3  # the KV write skips them
