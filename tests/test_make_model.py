"""scripts/make_model.py writes a checkpoint that transformers and the worker both read."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_config import ModelConfig
from scripts.make_model import PRESETS, SPECIAL_TOKENS, make_model


def test_tokenizer_round_trips_multibyte_text_and_knows_its_special_tokens(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["naïve café 日本語 🙂", "def f(x):\n    return x  # ok", "  leading and trailing  "]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    with_bos = tok.encode("hi")
    assert with_bos[0] == tok.bos_token_id == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert len(tok) <= AutoConfig.from_pretrained(tiny_model_dir).vocab_size


def test_chat_template_renders_llama3_style(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi café "}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi café<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS only, none added by tokenization


def test_config_and_eos_ids(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    tiny = PRESETS["tiny"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        tiny.hidden_size,
        tiny.num_layers,
        tiny.num_kv_heads,
    )
    assert config.rope_parameters["rope_type"] == "llama3"
    assert not config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected_eos = (tok.convert_tokens_to_ids("<|end_of_text|>"), tok.convert_tokens_to_ids("<|eot_id|>"))
    assert load_model_config(tiny_model_dir).eos_token_ids == expected_eos


def test_make_model_leaves_an_existing_checkpoint_alone(tiny_model_dir: Path) -> None:
    config = tiny_model_dir / "config.json"
    before = config.stat().st_mtime_ns
    assert make_model(tiny_model_dir) == tiny_model_dir
    assert config.stat().st_mtime_ns == before
    assert json.loads(config.read_text())["model_type"] == "llama"


def test_presets_have_consistent_head_shapes() -> None:
    for name, p in PRESETS.items():
        assert p.model_type in ("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text"), name
        # Qwen3's and Gemma's head_dim is their own; the others' is hidden_size / num_heads
        if p.model_type not in ("qwen3", "qwen3_moe", "gemma2", "gemma3_text"):
            assert p.hidden_size == p.num_heads * p.head_dim, name
        assert p.head_dim % 2 == 0, name
        assert p.num_heads % p.num_kv_heads == 0, name


def test_the_loader_reads_back_the_preset_it_was_written_from(tiny_model_dir: Path) -> None:
    # A preset is the worker's ModelConfig (plus the random weights' dtype and scale): no second description
    # of a model's shape to keep in line with the loader's.
    loaded = load_model_config(tiny_model_dir)
    preset = PRESETS["tiny"]
    assert isinstance(preset, ModelConfig)
    expected = {f.name: getattr(preset, f.name) for f in fields(ModelConfig)}
    expected |= {"vocab_size": loaded.vocab_size, "eos_token_ids": loaded.eos_token_ids}  # the tokenizer's
    assert {f.name: getattr(loaded, f.name) for f in fields(ModelConfig)} == expected


def test_no_weights_writes_the_checkpoints_every_file_but_its_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--no-weights (for the worker's --load-format dummy): config.json, generation_config.json and the
    tokenizer, each as the full checkpoint has it, and no weights; the large presets' shapes too."""
    out = make_model(tmp_path / "tiny", preset="tiny", weights=False)
    files = {p.name for p in out.iterdir()}
    assert files == {p.name for p in tiny_model_dir.iterdir() if p.suffix != ".safetensors"}
    for name in files:
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert load_model_config(out) == load_model_config(tiny_model_dir)
    big = load_model_config(make_model(tmp_path / "q30", preset="qwen3-30b-a3b", weights=False))
    assert (big.model_type, big.num_experts, big.moe_intermediate_size, big.vocab_size) == (
        "qwen3_moe",
        128,
        768,
        151936,
    )
    assert AutoConfig.from_pretrained(tmp_path / "q30").architectures == ["Qwen3MoeForCausalLM"]
