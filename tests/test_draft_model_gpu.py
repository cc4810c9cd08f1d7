"""The draft model proposer on a GPU: its decode steps replayed from CUDA graphs draft what eager execution
and transformers draft (skipped without CUDA; run on the device machine with `pytest -m gpu`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.worker.spec.draft_model import DraftModelProposer
from pagedserve.worker.spec.proposer import ProposeRow
from scripts.make_model import make_model
from tests.test_draft_model import K, Reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _proposer(target: Path, draft: Path, enforce_eager: bool) -> DraftModelProposer:
    worker = WorkerConfig(
        model=str(target), device="cuda", dtype="float32", block_size=16, max_model_len=512,
        max_num_seqs=8, enforce_eager=enforce_eager, swap_space=0,
    )  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model=str(draft))
    proposer = DraftModelProposer(worker, spec, "cuda", torch.float32, max_prefill_tokens=64)
    proposer.allocate_kv(256)
    return proposer


def test_graph_drafts_equal_eager_drafts_and_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    draft = make_model(tmp_path / "tiny-draft", preset="tiny-draft", seed=1)
    graphs, eager = _proposer(tiny_model_dir, draft, False), _proposer(tiny_model_dir, draft, True)
    assert graphs.graphs is not None and eager.graphs is None
    ref = Reference(draft)
    ref.model.to("cuda")
    rng = random.Random(0)
    # 10 rows: more than the largest graph (max_num_seqs 8) until some leave, then graph batches
    seqs = {i: [rng.randrange(4096) for _ in range(rng.randrange(1, 90))] for i in range(10)}
    for step in range(8):
        rows = [ProposeRow(seq_id, tokens, rng.randrange(1, K + 1)) for seq_id, tokens in seqs.items()]
        drafts = graphs.propose(rows)
        assert drafts == eager.propose(rows)
        for row, row_drafts in zip(rows, drafts, strict=True):
            if row_drafts:  # a long prompt may still be catching up (64 tokens a call)
                ids = torch.tensor([list(row.token_ids)], device="cuda")
                out = ref.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(row_drafts), do_sample=False
                )
                assert row_drafts == out[0, ids.shape[1] :].tolist()
            accepted = rng.randrange(len(row_drafts) + 1)
            seqs[row.seq_id] += row_drafts[:accepted] + [rng.randrange(4096)]
        if step == 3:
            for seq_id in (0, 1, 2):
                graphs.free(seq_id)
                eager.free(seq_id)
                del seqs[seq_id]
        graphs.pool.check_invariants()
    assert graphs.graphs.num_replays > graphs.num_kv_only_replays > 0


def test_graphs_follow_the_default_seats(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--max-num-seqs 0 (the default: seats follow the pool) gave the draft graphs of no size, so every draft
    step ran eagerly (17 ms a step on an H100 where 1.5 ms was due): the draft's graphs take the seats the
    target's pool gives."""
    draft = make_model(tmp_path / "tiny-draft", preset="tiny-draft", seed=1)
    worker = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype="float32", block_size=16, max_model_len=512,
        swap_space=0,
    )  # fmt: skip
    assert worker.max_num_seqs == 0
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model=str(draft))
    proposer = DraftModelProposer(worker, spec, "cuda", torch.float32, max_prefill_tokens=64)
    proposer.allocate_kv(256)
    assert proposer.graphs is not None and proposer.graphs.padded_size(1) is not None
    rows = [ProposeRow(0, list(range(1, 40)), K)]
    proposer.propose(rows)  # catching up
    assert proposer.propose([ProposeRow(0, list(range(1, 41)), K)])[0]
    assert proposer.graphs.num_replays > 0
