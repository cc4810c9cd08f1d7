"""Phi-3-mini's head size, 96 (hidden 3072 / 32 heads), on the Triton attention backend and the fused ops:
tiny random Phi-3 checkpoints with heads of 96 against transformers' Phi3ForCausalLM in float32, on the CPU
under TRITON_INTERPRET=1 (or on CUDA where there is one). The kernels pad the heads to 128 in registers; the
KV cache keeps 96 values per head and token."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.kernels.conftest import HAS_CUDA, INTERPRET
from tests.test_engine_correctness import _run_engine, transformers_generate
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

pytestmark = pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="Triton needs TRITON_INTERPRET=1 or CUDA")
DEVICE = "cpu" if INTERPRET else "cuda"
HEAD_DIM = 96
BASE = dict(
    hidden_size=2 * HEAD_DIM, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
    vocab_size=300, initializer_range=0.1, pad_token_id=None, eos_token_id=None, bos_token_id=None,
    max_position_embeddings=256,
)  # fmt: skip
VARIANTS = {
    # Phi-3-mini: every head its own KV head, all 96 dimensions rotated.
    "mini": dict(num_key_value_heads=2),
    # GQA (two query heads per KV head) and half of each head rotated (48 of 96: the fused RoPE's halves of
    # 24 padded to 32), longrope past a pretraining length of 24 with the long factors.
    "gqa-partial-longrope": dict(
        num_attention_heads=4,
        hidden_size=4 * HEAD_DIM,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=24,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + i / 24 for i in range(24)],
            "long_factor": [1.0 + i for i in range(24)],
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3_96(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config = Phi3Config(**{**BASE, **VARIANTS[request.param]})
    assert config.hidden_size // config.num_attention_heads == HEAD_DIM
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # unit gains would hide a misplaced norm
    path = tmp_path_factory.mktemp("phi3-96") / request.param
    hf.save_pretrained(path)
    return path, hf


def test_chunked_prefill_mixed_and_decodes_match_transformers_logits(phi3_96) -> None:
    model_dir, hf = phi3_96
    runner = make_runner(model_dir, device=DEVICE, attention_backend="triton", fused_ops=True)
    assert runner.model_config.head_dim == HEAD_DIM
    assert runner.model.layers[0].self_attn.backend.name == "triton"
    assert runner.kv.device_pool.shape[-1] == HEAD_DIM  # the pool is not padded: 96 values per head and token
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 30, runner.vocab_size))
    driver.step({0: 30})
    driver.add(1, _random_prompt(rng, 41, runner.vocab_size))
    driver.step({0: 1, 1: 20})  # a decode beside a chunk: the mixed path
    driver.step({0: 1, 1: 21})
    for _ in range(4):
        driver.step({0: 1, 1: 1})  # decodes alone
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


def test_greedy_matches_transformers_generate_through_continuous_batching(phi3_96) -> None:
    model_dir, hf = phi3_96
    rng = random.Random(5)
    prompts = [_random_prompt(rng, n, 300) for n in (25, 33, 47, 30)]
    prompts.append(prompts[2][:30] + [1, 2, 3])  # a shared prefix for the prefix cache
    expected = transformers_generate(hf, prompts, 10)
    config = WorkerConfig(
        model=str(model_dir), device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=48, fused_ops=True
    )
    runner = ModelRunner(config, attention_backend="triton")
    assert runner.model.layers[0].self_attn.backend.name == "triton"
    ours, _ = _run_engine(
        runner, prompts, SamplingParams(max_tokens=10, temperature=0.0), max_num_seqs=4,
        max_num_batched_tokens=40,
    )  # fmt: skip
    for i, want in enumerate(expected):
        assert ours[(i, 0)] == want, f"prompt {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA, TRITON_INTERPRET unset")
@pytest.mark.parametrize("piecewise_graphs", [False, True])
def test_gpu_greedy_with_cuda_graphs_matches_transformers(phi3_96, piecewise_graphs: bool) -> None:
    """Heads of 96 through the decode CUDA graphs and (piecewise) the mixed-step graphs, float32."""
    model_dir, hf = phi3_96
    rng = random.Random(7)
    # A short prompt only without longrope: the engine rotates every sequence with the long factors once
    # max_model_len passes the pretraining length (worker/models/rotary.py), transformers a sequence that
    # stays within it with the short ones.
    short = 26 if (hf.config.rope_parameters or {}).get("rope_type") == "longrope" else 9
    prompts = [_random_prompt(rng, n, 300) for n in (25, 31, 40, 57, short, 70)]
    expected = transformers_generate(hf, prompts, 12)
    config = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
        max_num_seqs=4, piecewise_graphs=piecewise_graphs,
    )  # fmt: skip
    runner = ModelRunner(config, attention_backend="triton")
    ours, _ = _run_engine(
        runner, prompts, SamplingParams(max_tokens=12, temperature=0.0), max_num_seqs=4,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )  # fmt: skip
    for i, want in enumerate(expected):
        assert ours[(i, 0)] == want, f"prompt {i}"
