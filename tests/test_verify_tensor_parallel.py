"""Speculative verification as decode rows under tensor parallelism (gloo on the CPU, two ranks): every rank
expands the same plan to the same rows, and the draft model, whole on every rank, drafts the same tokens on
each, so the ranks' tokens equal one process's without speculation: with n-gram drafts, with the target's
own checkpoint as its draft (every draft accepted), with the target's weights plus noise (most drafts
accepted, some rejected) and with a small draft of other shapes (whose heads two ranks could not split)."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.common.log import get_logger
from pagedserve.common.messages import SamplingParams, Shutdown, StepPlan, encode
from pagedserve.worker import server
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.parallel import ParallelContext, init_parallel
from scripts._servers import free_port
from scripts.make_model import make_model
from tests.engine_loop import run_engine
from tests.test_speculative_engine import NGRAM, prompts
from tests.test_tensor_parallel import WORLD_SIZE, Recorder, _worker_config, spawn_ranks

TIMEOUT_S = 180.0
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _specs(target_dir: Path, noisy_dir: Path, draft_dir: Path) -> dict[str, str]:
    def draft(model_dir: Path) -> str:
        return json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})

    specs = {"target_as_draft": draft(target_dir), "noisy_target": draft(noisy_dir)}
    return {"ngram": NGRAM, **specs, "draft_model": draft(draft_dir)}


def _noisy_copy(src: Path, dst: Path, scale: float) -> Path:
    """The checkpoint at `src` with Gaussian noise of `scale` times each projection's spread added to it: a
    draft that mostly agrees with the target (3%: about 4 drafts in 5 accepted on the prompts below)."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    tensors = load_file(src / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        t = tensors[name]
        tensors[name] = t + scale * t.std() * torch.randn(t.shape, generator=generator)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _engine(runner: ModelRunner, parallel: ParallelContext) -> dict[str, Any]:
    """The greedy requests through the scheduler core, each plan forwarded to the other ranks: the tokens,
    the speculation metrics and each plan's step id with whether it had draft slots."""
    ps = prompts(runner.vocab_size)[-5:]
    plans: list[tuple[int, bool]] = []

    def forward(plan: StepPlan) -> None:
        plans.append((plan.step_id, bool(plan.draft_slots)))
        parallel.forward_to_followers(encode(plan))

    run = run_engine(
        runner, [(p, GREEDY) for p in ps], pipelined=False, prefix="", on_plan=forward, max_num_seqs=8,
        max_num_batched_tokens=48, num_speculative_tokens=runner.num_speculative_tokens,
    )  # fmt: skip
    m = run.scheduler.metrics
    drafts = (m.spec_draft_tokens_total, m.spec_accepted_tokens_total)
    return {"tokens": run.tokens, "drafts": drafts, "plans": plans}


def _rank_main(
    rank: int, model_dir: Path, specs: dict[str, str], init_method: str, out_dir: Path, device: str
) -> None:
    torch.set_num_threads(1)
    tp = {"tensor_parallel_size": WORLD_SIZE, "rank": rank, "dist_init_method": init_method}
    cfg = _worker_config(model_dir, device, **tp)
    cfg, parallel = init_parallel(cfg, load_model_config(model_dir))
    log = get_logger(process="worker", rank=rank)
    for name, spec in specs.items():
        runner = ModelRunner(replace(cfg, speculative_config=spec), cfg.resolved_attention_backend, parallel)
        recorder = Recorder(runner)
        if rank == 0:
            run = _engine(runner, parallel)
            parallel.forward_to_followers(encode(Shutdown("next config")))
            result = recorder.result(**run)
        else:
            assert server._follow(runner, parallel, log) == 0
            result = recorder.result()
        torch.save(result, out_dir / f"{name}-rank{rank}.pt")
        runner.close()
    parallel.close()


def run_ranks(model_dir: Path, out_dir: Path, device: str = "cpu") -> dict[str, list[dict[str, Any]]]:
    """What each of two ranks recorded with each speculative config of `_specs` (gloo on the CPU; on CUDA,
    NCCL with one GPU per rank, the Triton kernels and CUDA graphs, the draft's own included)."""
    noisy_dir = _noisy_copy(model_dir, out_dir / "noisy-target", 0.03)
    draft_dir = make_model(out_dir / "tiny-draft", preset="tiny-draft", seed=1)
    specs = _specs(model_dir, noisy_dir, draft_dir)
    args = (model_dir, specs, f"tcp://127.0.0.1:{free_port()}", out_dir, device)
    spawn_ranks(_rank_main, args, TIMEOUT_S)
    return {name: [torch.load(out_dir / f"{name}-rank{r}.pt") for r in range(WORLD_SIZE)] for name in specs}


def greedy_without_speculation(model_dir: Path, device: str = "cpu") -> dict[tuple[int, int], list[int]]:
    """One process's greedy tokens without speculation on `device`."""
    cfg = _worker_config(model_dir, device)
    run = _engine(ModelRunner(cfg, cfg.resolved_attention_backend), ParallelContext())
    assert run["drafts"] == (0, 0)
    return run["tokens"]


SPEC_NAMES = ["ngram", "target_as_draft", "noisy_target", "draft_model"]


def check_ranks_verify_as_one_process(
    name: str, ranks: list[dict[str, Any]], single: dict[tuple[int, int], list[int]]
) -> None:
    """The two ranks agree with each other exactly and their tokens are one process's without speculation;
    the drafts of each config were verified, and accepted as the config implies."""
    rank0, rank1 = ranks
    assert rank1["outputs"] == rank0["outputs"]
    assert torch.equal(rank1["logits"], rank0["logits"])
    assert rank0["tokens"] == single
    drafted, accepted = rank0["drafts"]
    assert drafted > 0
    if name == "draft_model":  # random weights of other shapes: its drafts are verified and rejected
        return
    assert accepted > 0  # runs of several tokens in one step
    assert any(len(tokens) > len(seq_ids) for _, seq_ids, tokens in rank0["outputs"])
    if name == "noisy_target":  # its rejected drafts' KV is rolled back on every rank alike
        assert accepted < drafted
    if name == "target_as_draft":  # the draft is the target: its greedy tokens are the target's
        assert accepted == drafted
        # The case the followers got wrong: a plan without draft slots right after a step that accepted
        # drafts (the follower still had that step in flight when the plan came).
        accepting = {step for step, seq_ids, tokens in rank0["outputs"] if len(tokens) > len(seq_ids)}
        pairs = pairwise(rank0["plans"])
        assert any(step in accepting and not slots_next for (step, _), (_, slots_next) in pairs)


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_ranks(tiny_model_dir, tmp_path_factory.mktemp("tp-spec"))


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> dict[tuple[int, int], list[int]]:
    return greedy_without_speculation(tiny_model_dir)


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_two_ranks_verify_as_one_process_without_speculation(name, ranks, single) -> None:
    """(The followers finish the step in flight before a plan with draft slots, as rank 0 does: they
    failed such plans with 'draft slots past its known tokens' before; and before the next plan after a
    step that verified drafts: they launched it behind that step, computing from positions that its accepted
    drafts had moved, which gave both ranks other tokens than one process.)"""
    check_ranks_verify_as_one_process(name, ranks[name], single)
