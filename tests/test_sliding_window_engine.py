"""The memory side of sliding windows, end to end on the CPU: a tiny Mistral whose every layer slides over 8
tokens serves sequences far past the window from a KV pool too small to hold any of them whole (the blocks
behind the window go back to the pool), through the real scheduler core and the real model runner, and every
greedy output equals transformers' own MistralForCausalLM.generate for its prompt alone."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.kv_window import freeing_window
from pagedserve.worker.model_runner import ModelRunner
from tests.kernels.conftest import INTERPRET
from tests.test_engine_correctness import _run_engine, transformers_generate

WINDOW = 8
BLOCK_SIZE = 4
MAX_TOKENS = 56
NUM_KV_BLOCKS = 11  # 44 slots: each sequence grows to 60-100 tokens
SHAPE = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1, pad_token_id=None,
    bos_token_id=None, eos_token_id=None, sliding_window=WINDOW,
)  # fmt: skip


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The checkpoint, the prompts and transformers' greedy tokens for each prompt alone."""
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**SHAPE)).eval()
    path = tmp_path_factory.mktemp("swa") / "mistral"
    hf.save_pretrained(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)] for n in (3, 9, 17, 30, 44)]
    prompts.append(prompts[4][:40] + [1, 2, 3])  # shares 10 blocks with the one before: a prefix hit
    return path, prompts, transformers_generate(hf, prompts, MAX_TOKENS)


def _runner(path: Path, backend: str = "torch", num_kv_blocks: int = NUM_KV_BLOCKS) -> ModelRunner:
    config = WorkerConfig(
        model=str(path), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
        swap_space=0.01, attention_backend=backend,
    )  # fmt: skip
    return ModelRunner(config, attention_backend=backend)


@pytest.mark.parametrize(
    "policies",
    [dict(preemption_mode="recompute"), dict(preemption_mode="swap"), dict(enable_prefix_caching=False)],
    ids=["recompute", "swap", "no-prefix-cache"],
)
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_greedy_matches_transformers_far_past_the_window_in_a_small_pool(mistral, policies, pipelined):
    path, prompts, expected = mistral
    runner = _runner(path)
    window = freeing_window(runner.model_config, runner.spec)
    assert window == WINDOW
    ours, scheduler = _run_engine(
        runner,
        prompts,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        max_num_seqs=6,
        max_num_batched_tokens=8,  # chunked prefills; the peak a sequence holds is window + 2 chunks
        num_cpu_blocks=runner.num_cpu_blocks,
        pipelined=pipelined,
        sliding_window=window,
        **policies,
    )
    assert all(len(p) + MAX_TOKENS > NUM_KV_BLOCKS * BLOCK_SIZE for p in prompts)  # none fits whole
    assert scheduler.metrics.preemptions_total > 0  # the sequences did not fit the pool together either
    if policies.get("preemption_mode") == "swap":
        assert scheduler.metrics.swap_outs_total > 0
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i} (length {len(prompts[i])})"


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
def test_triton_kernels_never_need_a_freed_block(mistral):
    """The paged kernels (prefill, mixed, decode) read the tables with holes: they start at the window."""
    path, prompts, expected = mistral
    runner = _runner(path, backend="triton")
    ours, _ = _run_engine(
        runner,
        prompts[3:5],
        SamplingParams(max_tokens=24, temperature=0.0),
        max_num_seqs=2,
        max_num_batched_tokens=8,
        sliding_window=WINDOW,
    )
    for i, tokens in enumerate(expected[3:5]):
        assert ours[(i, 0)] == tokens[:24]


def test_kv_usage_falls_as_blocks_leave_the_window(mistral, monkeypatch):
    path, prompts, _ = mistral
    runner = _runner(path, num_kv_blocks=32)  # room for the bound on two 32-token steps beside the window
    used: list[int] = []
    schedule = Scheduler.schedule

    def watched(self: Scheduler):  # the engine loop's scheduler, its usage read after each plan
        plan = schedule(self)
        used.append(self.kv_usage().blocks_used)
        return plan

    monkeypatch.setattr(Scheduler, "schedule", watched)
    _run_engine(
        runner,
        [prompts[3]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        max_num_seqs=1,
        max_num_batched_tokens=32,
        sliding_window=WINDOW,
    )
    # The 30-token prompt in one step holds its 8 blocks; from the next step (its first query at 30 reads
    # 23..30) the blocks before position 20 are free: 3 blocks, and at most 4 from then on (the window over
    # 3 blocks and the next token's).
    assert used[0] == 8 and used[1] == 3 and max(used[1:]) <= 4


def test_only_a_model_whose_every_layer_slides_announces_a_window(mistral):
    config = _runner(mistral[0]).model_config
    assert config.layer_windows == (WINDOW, WINDOW) and freeing_window(config) == WINDOW
    assert freeing_window(replace(config, layer_windows=(16, 8))) == 8  # the smallest
    assert freeing_window(replace(config, layer_windows=(8, 0))) == 0  # Gemma-like: a global layer reads all
    assert freeing_window(replace(config, layer_windows=())) == 0  # every layer global
    # a draft model keeps every sequence's whole context in a pool of the target's size: no freeing
    draft = SimpleNamespace(proposer=SimpleNamespace(model_config=config))
    assert freeing_window(config, draft) == 0
    assert freeing_window(config, SimpleNamespace(proposer=object())) == WINDOW  # n-gram: reads no KV


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_gpu_triton_engine_frees_behind_the_window(tmp_path, preemption_mode, pipelined):
    """On CUDA: the Triton kernels (decode, prefill, mixed; CUDA graphs when pipelined) with the worker's
    block size of 16, a window of 40 that is no multiple of it, sequences of 100-400 tokens from a pool of 16
    blocks (256 slots); float32 greedy outputs equal transformers' on the same GPU."""
    torch.manual_seed(1)
    hf = MistralForCausalLM(MistralConfig(**{**SHAPE, "sliding_window": 40, "max_position_embeddings": 512}))
    hf.save_pretrained(tmp_path / "mistral")
    rng = random.Random(5)
    prompts = [[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)] for n in (1, 37, 64, 150, 300)]
    prompts.append(prompts[4][:200] + [7, 8])  # a prefix hit past the window
    hf = hf.cuda().eval()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                max_new_tokens=64,
                do_sample=False,
            )
        expected.append(ids[0, len(prompt) :].tolist())
    config = WorkerConfig(
        model=str(tmp_path / "mistral"), device="cuda", dtype="float32", num_kv_blocks=16, swap_space=0.05
    )
    runner = ModelRunner(config, attention_backend="triton")
    assert runner.block_size == 16 and freeing_window(runner.model_config, runner.spec) == 40
    ours, scheduler = _run_engine(
        runner, prompts, SamplingParams(max_tokens=64, temperature=0.0),
        max_num_seqs=4, max_num_batched_tokens=64, num_cpu_blocks=runner.num_cpu_blocks,
        preemption_mode=preemption_mode, pipelined=pipelined, sliding_window=40,
    )  # fmt: skip
    assert scheduler.metrics.preemptions_total > 0
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i} (length {len(prompts[i])})"
