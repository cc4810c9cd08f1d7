"""The draft chain on a GPU (worker/spec/draft_graphs.py): a steady-state `propose` replayed as one CUDA graph
drafts what the step-by-step path drafts (its decode graphs one step at a time) and writes the same KV, in
bfloat16 at the captured sizes and in float32 with padding rows; greedy outputs of the engine with the draft
model are those without speculation, and the chain ran (skipped without CUDA; `pytest -m gpu` on the device).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.spec.draft_model import DraftModelProposer
from pagedserve.worker.spec.proposer import ProposeRow
from scripts.make_model import make_model
from tests.test_speculative_engine import prompts, run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

K = 4


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("chain-gpu") / "tiny-draft", preset="tiny-draft", seed=1)


def _proposer(target: Path, draft: Path, dtype: torch.dtype, k: int = K) -> DraftModelProposer:
    worker = WorkerConfig(
        model=str(target), device="cuda", dtype=str(dtype).removeprefix("torch."), block_size=16,
        max_model_len=512, max_num_seqs=8, swap_space=0,
    )  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(draft))
    # every row catches up in its first call
    proposer = DraftModelProposer(worker, spec, "cuda", dtype, max_prefill_tokens=4096)
    proposer.allocate_kv(256)
    assert proposer.graphs is not None and proposer.chain is not None and proposer.chain.captured
    return proposer


def _compare(
    chained: DraftModelProposer, steps: DraftModelProposer, batches: list[int], k: int, mixed: bool
) -> None:
    """Both proposers through a catch-up and four steady-state calls per batch (with `mixed`, some rows asking
    for fewer drafts): the same drafts, KV and records; the chain ran for every steady-state call."""
    steps.chain = None
    rng = random.Random(0)
    for batch in batches:
        seqs = {
            100 * batch + i: [rng.randrange(4096) for _ in range(rng.randrange(2, 300))] for i in range(batch)
        }
        for call in range(5):
            nums = [k] + [rng.randint(1, k) if mixed else k for _ in range(batch - 1)]
            rng.shuffle(nums)
            rows = [ProposeRow(i, list(t), n) for (i, t), n in zip(seqs.items(), nums, strict=True)]
            before = chained.num_chain_replays
            drafts = steps.propose(rows)
            assert chained.propose(rows) == drafts and [len(d) for d in drafts] == nums
            assert chained.num_chain_replays == before + (call > 0)
            for seq_id, draft in zip(seqs, drafts, strict=True):
                accepted = rng.randrange(k + 1)
                seqs[seq_id] += draft[:accepted] + [rng.randrange(4096)]
        assert chained.pool is not None and steps.pool is not None
        for seq_id in seqs:
            a, b = steps.pool.seqs[seq_id], chained.pool.seqs[seq_id]
            assert (a.block_ids, a.computed, a.num_truth) == (b.block_ids, b.computed, b.num_truth)
        assert chained.kv is not None and steps.kv is not None
        for (k_a, v_a), (k_b, v_b) in zip(steps.kv.layers, chained.kv.layers, strict=True):
            torch.testing.assert_close(k_b, k_a)  # (bit-equal expected in bfloat16: the same kernels, shapes)
            torch.testing.assert_close(v_b, v_a)
        for seq_id in seqs:
            steps.free(seq_id)
            chained.free(seq_id)
    assert chained.num_kv_only_replays == steps.num_kv_only_replays > 0
    assert chained.chain is not None and chained.chain.num_replays == chained.num_chain_replays
    assert steps.num_chain_replays == 0


def test_bf16_chain_drafts_and_kv_equal_the_step_by_step_graphs(
    tiny_model_dir: Path, draft_dir: Path
) -> None:
    """At the captured sizes, every row drafting k, both paths run the same kernels on the same shapes (the LM
    head's included), so bfloat16's rounding cannot tell them apart: the same drafts. (Rows with fewer drafts
    shrink the step-by-step path's later batches, whose LM head may then round differently.)"""
    chained = _proposer(tiny_model_dir, draft_dir, torch.bfloat16)
    steps = _proposer(tiny_model_dir, draft_dir, torch.bfloat16)
    _compare(chained, steps, [1, 2, 4, 8], K, mixed=False)
    chain = chained.chain
    assert chain is not None and chained.graphs is not None
    print(
        f"draft decode graphs {chained.graphs.capture_time_s:.2f} s; chains (k={K}, sizes "
        f"{chained.graphs.sizes}) {chain.capture_time_s:.2f} s, {chain.capture_bytes / 2**20:.1f} MiB"
    )


@pytest.mark.parametrize("k", [1, K])
def test_f32_chain_with_padding_rows_equals_the_step_by_step_graphs(
    tiny_model_dir: Path, draft_dir: Path, k: int
) -> None:
    """Batches of 3, 5, 6, 7 replay the chain of 4 or 8 with padding rows, which write no KV; rows with fewer
    drafts than k write the KV of their own steps only."""
    chained = _proposer(tiny_model_dir, draft_dir, torch.float32, k)
    steps = _proposer(tiny_model_dir, draft_dir, torch.float32, k)
    _compare(chained, steps, [3, 1, 5, 6, 7], k, mixed=True)


def _runner(model_dir: Path, speculative: str = "") -> ModelRunner:
    config = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
        max_num_seqs=16, max_model_len=512, swap_space=0, speculative_config=speculative,
    )  # fmt: skip
    return ModelRunner(config, attention_backend="triton")


@pytest.mark.parametrize("draft_name", ["tiny-draft", "target"])
def test_greedy_outputs_with_the_chained_draft_equal_those_without(
    tiny_model_dir: Path, draft_dir: Path, draft_name: str
) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain = _runner(tiny_model_dir)
    expected = run_engine(plain, prompts(plain.vocab_size), greedy, pipelined=True, max_num_seqs=16)[0]
    plain.close()
    draft = draft_dir if draft_name == "tiny-draft" else tiny_model_dir  # the target: every draft accepted
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": K})
    runner = _runner(tiny_model_dir, spec)
    assert runner.spec is not None
    proposer = runner.spec.proposer
    assert isinstance(proposer, DraftModelProposer)
    ours, scheduler, _ = run_engine(runner, prompts(runner.vocab_size), greedy, False, max_num_seqs=16)
    assert ours == expected
    assert proposer.num_chain_replays > 0
    if draft_name == "target":
        assert scheduler.metrics.spec_accepted_tokens_total > 0
    runner.close()
