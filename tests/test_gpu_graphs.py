"""CUDA graphs for decode steps against eager execution of the same plans, on a GPU (skipped without CUDA;
run on the device machine with `pytest -m gpu`)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.cuda_graphs import capture_sizes
from pagedserve.worker.model_runner import ModelRunner
from tests.engine_loop import run_engine
from tests.test_engine_correctness import _run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256


def _runner(model_dir, enforce_eager: bool, dtype: str, piecewise_graphs: bool = False) -> ModelRunner:
    cfg = WorkerConfig(
        model=str(model_dir), device="cuda", dtype=dtype, num_kv_blocks=96, max_num_seqs=16,
        enforce_eager=enforce_eager, swap_space=0, piecewise_graphs=piecewise_graphs,
        max_num_batched_tokens=256,
    )  # fmt: skip
    return ModelRunner(cfg, attention_backend="triton")


def _generate(runner: ModelRunner, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy tokens of every prompt, batched by a scheduler core, each with its own output length."""
    requests = [
        (prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for prompt, n in zip(prompts, max_tokens, strict=True)
    ]
    run = run_engine(
        runner, requests, owner=b"t", eos_token_ids=(), max_num_seqs=16, max_num_batched_tokens=256
    )
    return [run.tokens.get((i, 0), []) for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_gives_the_tokens_of_eager_execution(tiny_model_dir, dtype: str) -> None:
    graphs, eager = _runner(tiny_model_dir, False, dtype), _runner(tiny_model_dir, True, dtype)
    assert graphs.graphs is not None and eager.graphs is None
    rng = random.Random(3)
    # 13 prompts of uneven lengths and output lengths: decode batches of 13 down to 1, padded to the graphs of
    # 16, 8, 4, 2 and 1 as sequences end.
    prompts = [[rng.randrange(graphs.vocab_size) for _ in range(rng.randint(1, 90))] for _ in range(13)]
    max_tokens = [rng.randint(5, 40) for _ in prompts]
    results = [_generate(runner, prompts, max_tokens) for runner in (graphs, eager)]
    assert graphs.graphs.num_replays > 0
    assert [len(t) for t in results[0]] == max_tokens
    if dtype == "float32":
        assert results[0] == results[1]
        return
    # The graph's split-KV choice (made for max_model_len) differs from eager's, so bf16 sums round
    # differently; where the two differ, the tokens must be near-tied under float32 logprobs. bf16 keeps 8
    # significant bits: logits of magnitude ~10 carry ~0.04 of rounding each, so two of them can swap
    # order when they are within ~0.1 nats.
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    for prompt, mine, theirs in zip(prompts, *results, strict=True):
        if mine == theirs:
            continue
        k = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + mine[:k]], device="cuda")).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        gap = abs(logprobs[mine[k]] - logprobs[theirs[k]]).item()
        assert gap < 0.1, f"token {k}: {mine[k]} vs {theirs[k]} differ by {gap:.3f} nats"


def test_piecewise_graphs_give_the_tokens_of_eager_execution(tiny_model_dir) -> None:
    pieces, eager = _runner(tiny_model_dir, False, "float32", True), _runner(tiny_model_dir, True, "float32")
    assert pieces.mixed_graphs is not None and pieces.mixed_graphs.sizes == [16, 32, 64, 128, 256]
    rng = random.Random(5)
    # Prefills of 1-200 tokens admitted beside running decodes: mixed steps of uneven sizes, padded.
    prompts = [[rng.randrange(pieces.vocab_size) for _ in range(rng.randint(1, 200))] for _ in range(9)]
    max_tokens = [rng.randint(3, 30) for _ in prompts]
    results = [_generate(runner, prompts, max_tokens) for runner in (pieces, eager)]
    assert pieces.mixed_graphs.num_runs > 1 and pieces.graphs is not None and pieces.graphs.num_replays > 0
    assert [len(t) for t in results[0]] == max_tokens
    assert results[0] == results[1]


@torch.inference_mode()
def test_padding_rows_leave_the_cache_untouched(tiny_model_dir) -> None:
    runner = _runner(tiny_model_dir, False, "float32")
    before = runner.kv.device_pool.clone()
    prompts = [list(range(1, n + 1)) for n in (3, 5, 20)]
    _run_engine(
        runner, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        max_num_seqs=16, max_num_batched_tokens=256,
    )  # fmt: skip
    assert runner.graphs is not None and runner.graphs.num_replays == 3  # batches of 3, padded to 4
    changed = (runner.kv.device_pool != before).flatten(3).any(-1)  # [L, 2, num_blocks]
    # The KV of tokens 0 .. len + 2 of each sequence: 1 + 1 + 2 blocks, and no write from the padding row.
    assert int(changed.any(0).any(0).sum()) == 4


def test_the_torch_reference_backend_runs_eagerly_on_cuda(tiny_model_dir) -> None:
    """It reads sequence lengths on the host, which no graph can hold: no graphs, and decodes still run."""
    cfg = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=32, max_num_seqs=4
    )
    runner = ModelRunner(cfg, attention_backend="torch")
    assert runner.graphs is None
    assert [len(t) for t in _generate(runner, [[1, 2, 3], [4, 5, 6, 7]], [5, 3])] == [5, 3]


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_bench_step_reports_gpu_time_per_kernel(tiny_model_dir, tmp_path, mode: str) -> None:
    import json

    from scripts.bench_step import main

    out = tmp_path / "step.json"
    argv = ["--model", str(tiny_model_dir), "--batch", "4", "--context", "40", "--steps", "3"]
    argv += ["--modes", mode]
    assert main([*argv, "--kernels", "3", "--json-out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    k = row["kernels"]
    # Kernels replayed from a CUDA graph are traced like eager ones: the attention, the matrix products and
    # the sampler are all there, and their times add up to the total.
    assert {"attention", "matmul", "sampler and other"} <= set(k["groups"])
    assert all(us > 0 for us in k["groups"].values())
    assert sum(k["groups"].values()) == pytest.approx(k["total_us"], abs=1.0)
    attention = [r for r in k["kernels"] if r["group"] == "attention"]
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert sum(r["calls"] for r in attention) >= layers
