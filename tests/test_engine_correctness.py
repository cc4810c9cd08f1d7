"""Greedy outputs through the real scheduler core and the real model runner, against transformers.

The scheduler and the worker run in one process here (no sockets), with a KV pool small enough that
sequences are preempted and recomputed several times; every sequence must still produce exactly what
transformers' own LlamaForCausalLM.generate produces for its prompt alone.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.engine_loop import run_engine

MAX_TOKENS = 24


def _run_engine(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    pipelined: bool = False,
    **settings,
):
    """Runs the prompts to the end (tests/engine_loop.py); returns {(prompt index, sample index): tokens}
    and the scheduler. `pipelined` runs the steps as the server and the worker do: the scheduler makes plan
    N+1 before step N's tokens are in, and the runner launches step N+1 before it finishes step N, so the
    tokens of step N reach step N+1 on the device."""
    run = run_engine(runner, [(prompt, params) for prompt in prompts], pipelined, **settings)
    return run.tokens, run.scheduler


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 3, 7, 16, 17, 29, 40, 64)]
    # shared prefixes, so the prefix cache has something to find: a copy, and two extensions
    return prompts + [list(prompts[6]), prompts[7][:33] + [5, 6, 7], prompts[5] + prompts[2]]


@pytest.fixture(scope="module")
def transformers_greedy(tiny_model_dir):
    """What transformers' own LlamaForCausalLM.generate produces for each prompt alone."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return transformers_generate(model, _prompts(model.config.vocab_size), MAX_TOKENS)


def transformers_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' own `generate` for each prompt alone, on the CPU."""
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        expected.append(ids[0, len(prompt) :].tolist())
    return expected


@pytest.mark.parametrize(
    "name,num_kv_blocks,policies",
    [
        ("roomy", 400, dict(preemption_mode="recompute")),
        ("recompute", 40, dict(preemption_mode="recompute")),
        ("recompute-no-prefix-cache", 40, dict(preemption_mode="recompute", enable_prefix_caching=False)),
        ("swap", 40, dict(preemption_mode="swap")),
        ("auto", 40, dict(preemption_mode="auto")),
    ],
)
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_greedy_matches_transformers_through_continuous_batching(
    tiny_model_dir, transformers_greedy, name, num_kv_blocks, policies, pipelined
):
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks,
        swap_space=0.05,
    )  # fmt: skip
    runner = ModelRunner(config)
    prompts = _prompts(runner.vocab_size)
    ours, scheduler = _run_engine(
        runner,
        prompts,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        max_num_seqs=8,
        max_num_batched_tokens=48,  # also splits the longer prompts into chunks
        num_cpu_blocks=runner.num_cpu_blocks,
        pipelined=pipelined,
        **policies,
    )
    assert (runner.num_tokens_fed > 0) == pipelined  # the decodes read their tokens on the device
    m = scheduler.metrics
    if name == "roomy":
        assert m.preemptions_total == 0
    else:
        assert m.preemptions_total >= 2
    if name == "swap":
        assert m.swap_outs_total >= 2
    if policies.get("enable_prefix_caching", True):
        assert m.prefix_cache_hits_total > 0
    for i, expected in enumerate(transformers_greedy):
        assert ours[(i, 0)] == expected, f"prompt {i} (length {len(prompts[i])})"


def test_seeded_sampling_is_reproducible_and_survives_preemption(tiny_model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 12, 30, 33)]
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    def run(num_kv_blocks: int, pipelined: bool = False):
        runner = ModelRunner(
            WorkerConfig(
                model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks
            )
        )
        return _run_engine(runner, prompts, params, pipelined, max_num_seqs=16, max_num_batched_tokens=64)

    roomy, _ = run(64)
    cramped, scheduler = run(5)
    assert scheduler.metrics.preemptions_total > 0
    assert cramped == roomy
    # Launched before the previous step finished: the same draws (seed and position), forks included.
    cramped_pipelined, scheduler = run(5, pipelined=True)
    assert scheduler.metrics.preemptions_total > 0
    assert cramped_pipelined == roomy
    assert all(len(tokens) == 16 for tokens in roomy.values())
    for i in range(len(prompts)):  # the n samples of a prompt are independent draws
        assert len({tuple(roomy[(i, j)]) for j in range(3)}) > 1


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("num_kv_blocks", [200, 16])
def test_beam_search_matches_transformers(tiny_model_dir, num_kv_blocks, pipelined):
    """Beams forked with shared blocks, copied on write, pruned and (with 16 blocks) preempted find what
    transformers' own beam search finds (EOS off, so both run to max_new_tokens)."""
    width, n, max_tokens = 3, 2, 8
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(k)] for k in (3, 9, 17)]
    config = GenerationConfig(
        num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens, do_sample=False,
        early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=config,
            )
        expected.append([row[len(prompt) :].tolist() for row in out])

    runner = ModelRunner(
        WorkerConfig(
            model=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_kv_blocks=num_kv_blocks,
        )
    )
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, beam_width=width, ignore_eos=True)
    ours, scheduler = _run_engine(
        runner, prompts, params, pipelined, max_num_seqs=16, max_num_batched_tokens=64
    )
    if num_kv_blocks == 16:
        assert scheduler.metrics.preemptions_total > 0
    for i, beams in enumerate(expected):
        assert [ours[(i, j)] for j in range(n)] == beams, f"prompt {i}"
