"""RoPE scaling (worker/models/rotary.py) against transformers: cos/sin of random configs of every rope type
against transformers' own rotary embeddings, the config reading in both layouts, and logits of tiny Llama
and Qwen2 checkpoints with yarn, dynamic NTK and longrope scaling through the runner (and, for dynamic NTK
past max_position_embeddings, against transformers' own generate, whose frequencies change per step)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_config import RopeScaling, rope_settings
from pagedserve.worker.models.rotary import rope_cos_sin
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=300, initializer_range=0.1, pad_token_id=None, eos_token_id=None,
)  # fmt: skip


def _random_rope(rng: random.Random, rope_type: str, dim: int) -> dict:
    rope = {"rope_type": rope_type, "rope_theta": rng.choice([10000.0, 500000.0, 1e6])}
    if rope_type != "longrope":
        rope["factor"] = rng.choice([2.0, 4.0, 8.0, 2.5])
    if rope_type == "llama3":
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = rng.choice([16, 24])
        rope |= rng.choice(
            [{}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"mscale": 0.7, "mscale_all_dim": 1.0},
             {"attention_factor": 1.3}, {"truncate": False}]
        )  # fmt: skip
    if rope_type == "longrope":
        rope["short_factor"] = [round(rng.uniform(1.0, 1.5), 3) for _ in range(dim // 2)]
        rope["long_factor"] = [round(rng.uniform(1.0, 8.0), 3) for _ in range(dim // 2)]
    return rope


def _hf_cos_sin(rotary, dim: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0, :, :dim], sin[0, :, :dim]


CASES = [
    (t, seed) for t in ("default", "linear", "llama3", "yarn", "dynamic", "longrope") for seed in range(3)
]


@pytest.mark.parametrize(("rope_type", "seed"), CASES)
def test_cos_sin_match_transformers_rotary_embeddings(rope_type: str, seed: int) -> None:
    rng = random.Random(seed)
    head_dim = rng.choice([16, 32, 24])
    max_pos = 32
    if rope_type == "longrope":  # Phi-3's, with a partial rotary factor now and then
        partial = rng.choice([1.0, 0.5])
        dim = int(head_dim * partial)
        raw_rope = _random_rope(rng, rope_type, dim)
        hf_config = Phi3Config(
            **{**TINY, "hidden_size": 4 * head_dim}, max_position_embeddings=4 * max_pos,
            original_max_position_embeddings=max_pos, rope_parameters=dict(raw_rope),
            partial_rotary_factor=partial,
        )  # fmt: skip
        hf = Phi3RotaryEmbedding(hf_config)
    else:
        dim = head_dim
        raw_rope = _random_rope(rng, rope_type, dim)
        hf_config = LlamaConfig(
            **TINY, head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(raw_rope)
        )
        hf = LlamaRotaryEmbedding(hf_config)
    raw = json.loads(hf_config.to_json_string())
    theta, scaling = rope_settings(raw)
    assert theta == raw_rope["rope_theta"] and (scaling is None) == (rope_type == "default")

    if rope_type == "dynamic":  # as in generate: each position the last of its forward, in order
        length = 3 * max_pos
        rows = [_hf_cos_sin(hf, dim, [p]) for p in range(length)]
        want = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        got = rope_cos_sin(dim, theta, scaling, length)
        # The engine computes the grown bases of all positions at once, transformers one position at a
        # time: float32 powers that differ in their last bit now and then (times the position: < 1e-5).
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # within max_position_embeddings, plain RoPE: transformers' for any sequence up to that length
        torch.testing.assert_close(
            got[0][:max_pos], rope_cos_sin(dim, theta, None, max_pos)[0], rtol=0, atol=0
        )
        return
    lengths = [max_pos]
    if rope_type == "longrope":  # the short factors up to the pretraining length, the long ones past it
        lengths = [max_pos, 3 * max_pos]
    elif rope_type in ("yarn", "linear"):
        lengths = [max_pos, 2 * max_pos]
    for length in lengths:
        want = _hf_cos_sin(hf, dim, list(range(length)))
        got = rope_cos_sin(dim, theta, scaling, length)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_config_reading_in_both_layouts() -> None:
    factors = {"short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}
    old = {
        "model_type": "phi3", "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
        "rope_theta": 5000.0, "rope_scaling": {"type": "su", **factors},
    }  # fmt: skip
    theta, scaling = rope_settings(old)
    assert theta == 5000.0 and scaling == RopeScaling(
        "longrope", 4.0, original_max_position_embeddings=256, short_factor=(1.0, 1.5), long_factor=(2.0, 3.0)
    )  # factor: 1024 / 256
    yarn = {
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
        },
    }  # fmt: skip
    theta, scaling = rope_settings(yarn)
    assert theta == 1e6 and scaling == RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=1024, beta_fast=32.0, mscale=1.0, mscale_all_dim=0.5,
        truncate=False,
    )  # fmt: skip
    theta, scaling = rope_settings(
        {"max_position_embeddings": 512, "rope_scaling": {"type": "dynamic", "factor": 2}}
    )
    assert scaling == RopeScaling("dynamic", 2.0, original_max_position_embeddings=512)
    with pytest.raises(ValueError, match="needs a factor"):
        rope_settings({"rope_scaling": {"type": "dynamic"}})


def _save(
    tmp_path: Path, family: str, rope: dict, max_pos: int, seed: int = 0, **extra
) -> tuple[Path, torch.nn.Module]:
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    head_dim = {"head_dim": 16} if family == "llama" else {}
    config = config_class(**TINY, **head_dim, max_position_embeddings=max_pos, rope_parameters=rope, **extra)
    torch.manual_seed(seed)
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def _prefill_chunked_and_decode(runner, lengths: dict[int, int], decodes: int, seed: int) -> Driver:
    driver = Driver(runner, seed=seed)
    rng = random.Random(seed)
    for seq_id, n in lengths.items():
        driver.add(seq_id, _random_prompt(rng, n, runner.vocab_size))
    first = {s: min(n, 13) for s, n in lengths.items()}  # chunked: the rest in a second step
    driver.step(first)
    rest = {s: n - first[s] for s, n in lengths.items() if n > first[s]}
    if rest:
        driver.step({**rest, **{s: 1 for s in lengths if s not in rest}})
    for _ in range(decodes):
        driver.step(dict.fromkeys(lengths, 1))
    return driver


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
    "short_factor": [1.0, 1.1, 1.2, 1.3, 1.05, 1.15, 1.25, 1.35],
    "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 20.0],
}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("fused_ops", [False, True])
def test_yarn_logits_match_transformers_past_the_pretraining_length(
    tmp_path: Path, family: str, fused_ops: bool
) -> None:
    model_dir, hf = _save(tmp_path, family, dict(YARN), max_pos=16)
    assert load_model_config(model_dir).max_position_embeddings == 64  # original x factor
    runner = make_runner(model_dir, fused_ops=fused_ops)
    assert runner.max_model_len == 64
    driver = _prefill_chunked_and_decode(runner, {0: 9, 1: 30, 2: 50}, decodes=6, seed=1)
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


@pytest.mark.parametrize("max_model_len", [24, 96])  # within the pretraining length: short; past it: long
def test_longrope_logits_match_transformers(tmp_path: Path, max_model_len: int) -> None:
    model_dir, hf = _save(tmp_path, "qwen2", dict(LONGROPE), max_pos=96)
    runner = make_runner(model_dir, max_model_len=max_model_len)
    # transformers takes the long factors for a sequence longer than 24, the short ones otherwise
    lengths = {0: 5, 1: 12} if max_model_len == 24 else {0: 25, 1: 40}
    driver = _prefill_chunked_and_decode(runner, lengths, decodes=10, seed=2)
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


def test_dynamic_ntk_matches_transformers_within_and_past_max_position_embeddings(tmp_path: Path) -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model_dir, hf = _save(tmp_path, "llama", rope, max_pos=32)
    runner = make_runner(model_dir)
    assert runner.max_model_len == 64  # max_position_embeddings x factor
    within = _prefill_chunked_and_decode(runner, {0: 7, 1: 20}, decodes=8, seed=3)
    _assert_logits_match_hf(within, hf, dict(within.tokens))  # plain RoPE up to 32 tokens

    # Past it: transformers' generate recomputes the frequencies at every step; each token's logits match.
    rng = random.Random(4)
    prompt = _random_prompt(rng, 20, runner.vocab_size)
    steps = 30  # to position 49
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=steps, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    driver = Driver(make_runner(model_dir), seed=4)
    driver.add(0, prompt)
    driver.step({0: 20})
    for _ in range(steps - 1):
        driver.step({0: 1})
    assert driver.tokens[0] == out.sequences[0].tolist()
    assert len(driver.records) == len(out.logits) == steps
    for (_, index, row), want in zip(driver.records, out.logits, strict=True):
        diff = (row - want[0]).abs().max().item()
        assert diff < 1e-3, f"token {index}: max abs logits diff {diff}"
