"""The engine on a GPU: scheduler core + model runner on CUDA with the Triton kernels, against transformers
on the same GPU. Skipped without CUDA (CI has none); run on the device machine with `pytest -m gpu`."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from scripts.make_model import make_model
from tests.test_engine_correctness import _run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_TOKENS = 32


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100, 300)]
    return prompts + [prompts[5] + [3, 4], list(prompts[6])]  # prefix-cache hits


def _transformers_greedy(model_dir, prompts, dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        expected.append(ids[0, len(prompt) :].tolist())
    return expected


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_triton_engine_float32_matches_transformers_exactly(tiny_model_dir, preemption_mode, pipelined):
    """Pipelined: each step launched behind the previous one (CUDA graphs, tokens fed on the device)."""
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=24, swap_space=0.05
    )
    runner = ModelRunner(config, attention_backend="triton")
    prompts = _prompts(runner.vocab_size)
    ours, scheduler = _run_engine(
        runner, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        max_num_seqs=8, max_num_batched_tokens=128, num_cpu_blocks=runner.num_cpu_blocks,
        preemption_mode=preemption_mode, pipelined=pipelined,
    )  # fmt: skip
    assert scheduler.metrics.preemptions_total > 0 and scheduler.metrics.prefix_cache_hits_total > 0
    assert (runner.num_tokens_fed > 0) == pipelined
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    expected = _transformers_greedy(tiny_model_dir, prompts, torch.float32)
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i}"


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny"])
def test_triton_engine_float32_matches_transformers_on_qwen(tmp_path_factory, preset):
    """Qwen2's q/k/v biases and Qwen3's q/k norms, head_dim 64 and tied lm_head, through the Triton kernels
    and CUDA graphs."""
    model_dir = make_model(tmp_path_factory.mktemp("models") / preset, preset=preset, seed=0)
    config = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=24, swap_space=0.05
    )
    runner = ModelRunner(config, attention_backend="triton")
    prompts = _prompts(runner.vocab_size)
    ours, scheduler = _run_engine(
        runner, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        max_num_seqs=8, max_num_batched_tokens=128, num_cpu_blocks=runner.num_cpu_blocks,
        preemption_mode="recompute",
    )  # fmt: skip
    assert scheduler.metrics.preemptions_total > 0 and scheduler.metrics.prefix_cache_hits_total > 0
    expected = _transformers_greedy(model_dir, prompts, torch.float32)
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i}"


def test_triton_engine_bfloat16_diverges_from_transformers_only_at_near_ties(tiny_model_dir):
    """bf16 rounds differently in every implementation, so where two tokens are nearly tied greedy decoding
    may pick either, and the rest of the sequence follows. Each sequence must equal transformers' bf16 output
    up to its first difference, and there the two tokens must be near-tied under float32 logprobs."""
    config = WorkerConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256)
    runner = ModelRunner(config, attention_backend="triton")
    prompts = _prompts(runner.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ours, _ = _run_engine(runner, prompts, params, max_num_seqs=16, max_num_batched_tokens=512)
    expected = _transformers_greedy(tiny_model_dir, prompts, torch.bfloat16)
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    identical = 0
    for i, (prompt, theirs) in enumerate(zip(prompts, expected, strict=True)):
        mine = ours[(i, 0)]
        if mine == theirs:
            identical += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + mine[:k]], device="cuda")).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        gap = abs(logprobs[mine[k]] - logprobs[theirs[k]]).item()
        assert gap < 0.05, f"prompt {i}, token {k}: {mine[k]} vs {theirs[k]} differ by {gap:.3f} nats"
    print(f"bf16: {identical} of {len(prompts)} sequences identical to transformers for {MAX_TOKENS} tokens")
