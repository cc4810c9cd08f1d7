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

from pagedserve.common.config import WorkerConfig
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.inputs import build_inputs
from pagedserve.worker.sequences import BlockTableArray
from pagedserve.worker.spec.device_drafts import DeviceDrafts
from pagedserve.worker.spec.draft_graphs import DraftChain, chain_inputs
from pagedserve.worker.spec.draft_model import DraftModelProposer
from pagedserve.worker.spec.proposer import ProposeRow
from scripts.make_model import make_model
from tests.test_draft_model import Reference

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


def _round(
    steps: DraftModelProposer,
    chained: DraftModelProposer,
    seqs: dict[int, list[int]],
    nums: list[int],
    k: int,
) -> tuple[list[list[int]], int]:
    """One call of both proposers on the same rows (row i asks for nums[i] drafts): the same drafts, state
    and KV. Returns the drafts and how many times the chain ran."""
    rows = [
        ProposeRow(seq_id, list(tokens), n) for (seq_id, tokens), n in zip(seqs.items(), nums, strict=True)
    ]
    before = chained.num_chain_replays
    (a, drafts), (b, chain_drafts) = _propose(steps, rows), _propose(chained, rows)
    assert chain_drafts == drafts
    assert b.tokens.shape == a.tokens.shape and b.counts == a.counts
    _assert_same_state(steps, chained)
    return drafts, chained.num_chain_replays - before


def _grow(seqs: dict[int, list[int]], drafts: list[list[int]], rng: random.Random) -> None:
    """The target accepts some drafts of each row and adds its own token."""
    for tokens, draft in zip(seqs.values(), drafts, strict=True):
        accepted = rng.randrange(len(draft) + 1)
        tokens += draft[:accepted] + [rng.choice([t for t in range(50) if draft[accepted:][:1] != [t]])]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_eager_chain_drafts_and_writes_what_the_step_by_step_path_does(
    tiny_model_dir: Path, draft_dir: Path, k: int
) -> None:
    steps, chained = (
        _proposer(tiny_model_dir, draft_dir, k, False),
        _proposer(tiny_model_dir, draft_dir, k, True),
    )
    rng = random.Random(k)
    crossed = 0
    for batch in range(1, 6):
        seqs = {
            100 * batch + i: [rng.randrange(4096) for _ in range(rng.randrange(2, 40))] for i in range(batch)
        }
        for call in range(4):  # a catch-up (step by step), steady-state calls (chained)
            # Some rows ask for fewer drafts; in the last call all do (unless k = 1): the step-by-step path.
            most = k if call < 3 or k == 1 else k - 1
            nums = [most] + [rng.randint(1, most) for _ in range(batch - 1)]
            rng.shuffle(nums)
            drafts, ran = _round(steps, chained, seqs, nums, k)
            assert [len(d) for d in drafts] == nums
            assert ran == (call > 0 and most == k)
            if ran:  # rows whose chain crosses into another block
                crossed += sum(
                    (len(t) - 1) // BLOCK_SIZE != (len(t) + n - 1) // BLOCK_SIZE
                    for t, n in zip(seqs.values(), nums, strict=True)
                )
            _grow(seqs, drafts, rng)
        for seq_id in seqs:
            steps.free(seq_id)
            chained.free(seq_id)
    assert crossed >= 5
    assert chained.chain is not None and chained.chain.num_replays == chained.num_chain_replays


def test_a_row_near_max_model_len_drafts_fewer_inside_a_chain(tiny_model_dir: Path, draft_dir: Path) -> None:
    """Its steps past its drafts stay at its last position (RoPE covers no further) and write nothing."""
    k = 4
    steps, chained = (
        _proposer(tiny_model_dir, draft_dir, k, False),
        _proposer(tiny_model_dir, draft_dir, k, True),
    )
    ref = Reference(draft_dir)
    rng = random.Random(3)
    seqs = {1: [rng.randrange(4096) for _ in range(125)], 2: [rng.randrange(4096) for _ in range(9)]}
    _round(steps, chained, seqs, [k, k], k)  # catching up
    for length in (126, 127):  # max_model_len 128: 2, then 1 draft
        seqs[1].append(rng.randrange(4096))
        seqs[2].append(rng.randrange(4096))
        assert len(seqs[1]) == length
        drafts, ran = _round(steps, chained, seqs, [k, k], k)
        assert ran == 1 and [len(d) for d in drafts] == [128 - length, k]
        assert drafts == [ref.greedy(t, len(d)) for t, d in zip(seqs.values(), drafts, strict=True)]


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
    assert call([0, 1, 2, 3], {1: 2}) == 1  # fewer drafts for one row: masked in the chain
    assert call([0, 1, 2, 3], {0: 3, 1: 2, 2: 1, 3: 3}) == 0  # fewer for every row
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
    num_drafts = np.array([4, 1, 3, 4, 2], dtype=np.int64)
    lengths = np.array(
        [rng.integers(1, n * BLOCK_SIZE - d + 1) for n, d in zip(held, num_drafts, strict=True)],
        dtype=np.int64,
    )
    width = int(held.max())
    padded = 8  # three padding rows after the five
    lens, drafts = torch.zeros(padded, dtype=torch.int64), torch.zeros(padded, dtype=torch.int64)
    lens[:5], drafts[:5] = torch.from_numpy(lengths), torch.from_numpy(num_drafts)
    block_tables = torch.zeros(padded, width, dtype=torch.int32)
    block_tables[:5] = torch.from_numpy(tables.tables[rows, :width])
    steps = torch.arange(k + 1).unsqueeze(1)
    positions, slots, seq_lens = chain_inputs(lens, drafts, block_tables, steps, BLOCK_SIZE)
    for j in range(k + 1):
        one = np.ones(5, dtype=np.int64)
        # past its drafts a row stays at its last step's position and context, and writes nothing
        want = build_inputs(
            tables, np.array(rows), lengths - 1 + np.minimum(j, num_drafts), one, 0 * one, BLOCK_SIZE
        )
        assert positions[j, :5].tolist() == want.positions.tolist()
        assert slots[j, :5].tolist() == np.where(j <= num_drafts, want.slot_mapping, -1).tolist()
        assert seq_lens[j, :5].tolist() == want.seq_lens.tolist()
        assert positions[j, 5:].tolist() == [0] * 3 and seq_lens[j, 5:].tolist() == [1] * 3
        assert slots[j, 5:].tolist() == [-1] * 3  # the KV write skips them
