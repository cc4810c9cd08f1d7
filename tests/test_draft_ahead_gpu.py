"""Drafting ahead on a GPU (worker/spec/ahead.py): the draft's decode graphs, drafts on the device put
together by index from two calls' tables (pinned copies, events), the target's verification replaying its
decode graphs. Greedy outputs as without speculation and the same drafts verified as without drafting
ahead; hand-made plans whose rows differ get each row's own drafts (skipped without CUDA; `pytest -m gpu`
on the device)."""

from __future__ import annotations

import json
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
from tests import engine_loop
from tests.test_draft_ahead import rows_differ_scenario
from tests.test_speculative_engine import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _config(model_dir: Path, speculative: str = "", num_kv_blocks: int = 256, **kw: object) -> WorkerConfig:
    return WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=num_kv_blocks,
        max_num_seqs=16, max_model_len=512, swap_space=0, speculative_config=speculative, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _runner(model_dir: Path, speculative: str = "", num_kv_blocks: int = 256) -> ModelRunner:
    return ModelRunner(_config(model_dir, speculative, num_kv_blocks), attention_backend="triton")


def _spec(model: Path, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


def _run(runner: ModelRunner, draft_ahead: bool = True, **kw: object) -> engine_loop.EngineRun:
    ps = prompts(runner.vocab_size)
    return engine_loop.run_engine(
        runner, [(p, GREEDY) for p in ps], True, draft_ahead=draft_ahead, max_num_seqs=16,
        max_num_batched_tokens=256, num_speculative_tokens=runner.num_speculative_tokens, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft") / "tiny-draft", preset="tiny-draft", seed=1)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> dict:
    runner = _runner(tiny_model_dir)
    out = _run(runner).tokens
    runner.close()
    return out


@pytest.mark.parametrize("draft", ["target", "tiny-draft"])
def test_drafting_ahead_on_the_gpu_keeps_the_outputs_and_the_drafts(
    tiny_model_dir: Path, draft_dir: Path, plain: dict, draft: str
) -> None:
    model = tiny_model_dir if draft == "target" else draft_dir
    results = {}
    for ahead in (True, False):
        runner = _runner(tiny_model_dir, _spec(model))
        assert runner.graphs is not None and runner.spec.proposer.graphs is not None
        run = _run(runner, ahead, speculative_min_accepted=0.0)
        assert run.tokens == plain
        m = run.scheduler.metrics
        results[ahead] = (run.steps, m.spec_draft_tokens_total, m.spec_accepted_tokens_total)
        assert m.spec_draft_tokens_total > 0
        if ahead:
            assert runner.spec.ahead.num_calls > 0 and runner.spec.ahead.num_rows_taken > 0
        runner.spec.proposer.pool.check_invariants()
        runner.close()
    if draft == "target":  # every draft accepted either way: the same steps and drafts
        assert results[True] == results[False]
        assert results[True][1] == results[True][2]


def test_a_plan_whose_rows_differ_gets_each_rows_own_drafts_on_the_gpu(
    tiny_model_dir: Path, draft_dir: Path
) -> None:
    """The CPU test's plans (tests/test_draft_ahead.py) on CUDA with graphs; each row's drafts against a
    fresh draft model on the same device proposing for that row alone."""
    runner = _runner(tiny_model_dir, _spec(draft_dir), num_kv_blocks=64)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model=str(draft_dir))
    fresh = DraftModelProposer(_config(tiny_model_dir, num_kv_blocks=64), spec, "cuda", torch.float32)
    fresh.allocate_kv(64)
    calls = iter(range(1 << 20))

    def greedy(tokens: list[int], n: int) -> list[int]:
        seq_id = next(calls)
        drafts = fresh.propose([ProposeRow(seq_id, tokens, n)])[0]
        fresh.free(seq_id)
        return drafts

    rows_differ_scenario(runner, greedy)
    runner.close()
