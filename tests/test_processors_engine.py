"""Penalties and min_tokens through the real scheduler core and model runner on the CPU, against a greedy
loop over transformers' own LlamaForCausalLM with transformers' own logits processors
(RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor) or, for OpenAI's presence and
frequency penalties that transformers lacks, the formula written here; and seeded sampling with every
processor on, reproducible through preemption by recompute and by swap, pipelined or not, with forks."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaForCausalLM,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.test_engine_correctness import _run_engine


def _runner(model_dir: Path, num_kv_blocks: int = 64, **kw) -> ModelRunner:
    cfg = WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, **kw)
    return ModelRunner(cfg)


def _greedy(model, prompt: list[int], max_new: int, processors: LogitsProcessorList, stops=()) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(ids).logits[:, -1].float()
            token = int(processors(ids, logits).argmax(dim=-1))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in stops:
                break
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (2, 5, 9, 17)]


def test_repetition_penalty_matches_transformers_processor(tiny_model_dir, hf_model) -> None:
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.8, ignore_eos=True)
    outputs, _ = _run_engine(
        _runner(tiny_model_dir), prompts, params, max_num_seqs=8, max_num_batched_tokens=64
    )
    plain, _ = _run_engine(
        _runner(tiny_model_dir),
        prompts,
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8)])
    for i, prompt in enumerate(prompts):
        assert outputs[(i, 0)] == _greedy(hf_model, prompt, 20, processors)
    assert outputs != plain  # the penalty changed something


class _OpenAIPenalties:
    """presence and frequency penalties over the generated tokens, as OpenAI documents them."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, count in Counter(ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.presence + self.frequency * count
        return scores


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_presence_and_frequency_penalties_match_the_formula(tiny_model_dir, hf_model, pipelined) -> None:
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, presence_penalty=0.7, frequency_penalty=0.9, ignore_eos=True
    )
    outputs, _ = _run_engine(
        _runner(tiny_model_dir), prompts, params, pipelined, max_num_seqs=8, max_num_batched_tokens=64
    )
    for i, prompt in enumerate(prompts):
        penalties = LogitsProcessorList([_OpenAIPenalties(len(prompt), 0.7, 0.9)])
        assert outputs[(i, 0)] == _greedy(hf_model, prompt, 20, penalties)


@pytest.fixture(scope="module")
def early_eos_model(tiny_model_dir, hf_model, tmp_path_factory) -> tuple[Path, list[int], int]:
    """The tiny checkpoint with its EOS set to the token greedy decoding of a prompt emits second: without
    min_tokens that prompt stops after two tokens."""
    prompt = _prompts(hf_model.config.vocab_size)[2]
    first_two = _greedy(hf_model, prompt, 2, LogitsProcessorList())
    eos = first_two[1]
    assert eos != first_two[0]
    model_dir = tmp_path_factory.mktemp("early-eos") / "tiny-llama"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [eos]}))
    return model_dir, prompt, eos


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_min_tokens_suppresses_eos_until_reached(early_eos_model, hf_model, pipelined) -> None:
    model_dir, prompt, eos = early_eos_model
    runner = _runner(model_dir)
    assert runner.eos_token_ids == [eos]
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64)
    short, _ = _run_engine(runner, [prompt], SamplingParams(temperature=0.0, max_tokens=30), pipelined, **kw)
    assert len(short[(0, 0)]) == 2 and short[(0, 0)][-1] == eos  # EOS, kept, ends it
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8)
    outputs, _ = _run_engine(_runner(model_dir), [prompt], params, pipelined, **kw)
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(len(prompt), 8, [eos])])
    expected = _greedy(hf_model, prompt, 30, processors, stops=(eos,))
    assert outputs[(0, 0)] == expected and len(expected) >= 8
    assert eos not in expected[:8]


def test_seeded_sampling_with_every_processor_survives_preemption(tiny_model_dir) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 12, 30)]
    params = SamplingParams(
        n=2,
        max_tokens=16,
        temperature=1.0,
        top_p=0.95,
        seed=99,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        min_p=0.02,
        min_tokens=4,
        logit_bias=((17, 3.0), (5, -100.0)),
        bad_words=((3,), (17, 17)),
    )

    def run(num_kv_blocks: int, pipelined: bool = False, **kw):
        runner = _runner(tiny_model_dir, num_kv_blocks, **kw)
        return _run_engine(runner, prompts, params, pipelined, max_num_seqs=16, max_num_batched_tokens=64)

    roomy, _ = run(64)
    for tokens in roomy.values():
        assert 3 not in tokens and 5 not in tokens
        assert all(not (a == 17 and b == 17) for a, b in zip(tokens, tokens[1:], strict=False))
    cramped, scheduler = run(5, pipelined=True)
    assert scheduler.metrics.preemptions_total > 0 and cramped == roomy
    runner = _runner(tiny_model_dir, 5, swap_space=0.05)
    swapped, scheduler = _run_engine(
        runner,
        prompts,
        params,
        True,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        num_cpu_blocks=runner.num_cpu_blocks,
    )
    assert scheduler.metrics.swap_outs_total > 0 and swapped == roomy
    for i in range(len(prompts)):  # forks draw independently
        assert roomy[(i, 0)] != roomy[(i, 1)]
