"""Writes a Llama, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 2 or Gemma 3 (text) checkpoint with random weights
and a locally trained tokenizer.

Nothing can be downloaded where this project is developed and tested, so every model it serves is made here:
a byte-level BPE tokenizer trained on the Python standard library's top-level modules (text every machine
with Python has), wrapped as a transformers fast tokenizer with a Llama-3-style chat template, and a
`LlamaForCausalLM` (or `Qwen2ForCausalLM`, `Qwen3ForCausalLM`) of a preset shape with seeded random weights,
saved with `save_pretrained`.

    python scripts/make_model.py --out models/tiny-llama [--preset tiny] [--seed 0] [--force]

The larger presets keep the real vocabulary size (128256 for Llama, 151936 for Qwen) for realistic memory and
speed, but their tokenizer is still the small trained one, Qwen's included: ids past the tokenizer's
vocabulary decode to nothing.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

# The lead moves ModelConfig to worker/model_config.py at the merge of issue 26.
from pagedserve.worker.model_config import ModelConfig, RopeScaling  # noqa: E402

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOKENIZER_VOCAB_SIZE = 4096  # special tokens included

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Preset(ModelConfig):
    """A model shape as the worker reads it back (`ModelConfig`; `vocab_size` 0: the tokenizer's size, the
    EOS ids the tokenizer's), plus what only the writing of random weights needs."""

    dtype: str = "float32"  # saved weights
    initializer_range: float = 0.02  # std of the random weights


def _preset(
    model_type: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    dtype: str,
    initializer_range: float,
    rope_scaling: RopeScaling | None = None,
    tie_word_embeddings: bool = False,
    experts: tuple[int, int, int] = (0, 0, 0),  # Qwen3-MoE: (num_experts, top-k, moe_intermediate_size)
) -> Preset:
    """Llama (RoPE theta 500k, eps 1e-5) or Qwen (theta 1e6, eps 1e-6; Qwen2 biases q/k/v, Qwen3 and
    Qwen3-MoE norm q/k; Qwen3-MoE's top-k weights renormalised, as Qwen3-30B-A3B's)."""
    llama = model_type == "llama"
    num_experts, top_k, moe_intermediate_size = experts
    return Preset(
        model_type=model_type,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        rms_norm_eps=1e-5 if llama else 1e-6,
        rope_theta=500000.0 if llama else 1e6,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=model_type == "qwen2",
        o_proj_bias=False,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        mlp_bias=False,
        eos_token_ids=(),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        dtype=dtype,
        initializer_range=initializer_range,
    )


def _rope_parameters(scaling: RopeScaling) -> dict[str, Any]:
    """The rope parameters of config.json for `scaling`: its type, factor and pretraining length, and its
    other fields where they differ from their defaults (longrope's factors as lists)."""
    defaults = RopeScaling(scaling.rope_type, scaling.factor)
    always = ["rope_type", "factor", "original_max_position_embeddings"]
    if scaling.rope_type == "llama3":  # transformers requires them, defaults or not
        always += ["low_freq_factor", "high_freq_factor"]
    params = {
        f.name: getattr(scaling, f.name)
        for f in fields(RopeScaling)
        if f.name in always or getattr(scaling, f.name) != getattr(defaults, f.name)
    }
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def _gemma_preset(
    model_type: str,  # "gemma2" or "gemma3_text"
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    dtype: str,
    initializer_range: float,
    sliding_window: int,
    sliding_window_pattern: int,  # every this many layers one is global
    query_pre_attn_scalar: float,
) -> Preset:
    """Gemma 2 (soft-caps 50 and 30, RoPE theta 10k) or Gemma 3 (q/k norms, no soft-caps, theta 1M for the
    global layers and 10k for the sliding ones); tied embeddings, eps 1e-6, GELU-tanh."""
    gemma2 = model_type == "gemma2"
    windows = tuple(sliding_window if (i + 1) % sliding_window_pattern else 0 for i in range(num_layers))
    base = _preset(
        model_type, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size,
        max_position_embeddings, dtype, initializer_range, tie_word_embeddings=True,
    )  # fmt: skip
    return replace(
        base,
        rope_theta=10000.0 if gemma2 else 1e6,
        qk_norm=not gemma2,
        layer_windows=windows,
        attn_logit_softcap=50.0 if gemma2 else 0.0,
        final_logit_softcap=30.0 if gemma2 else 0.0,
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_rope_theta=0.0 if gemma2 else 10000.0,
        hidden_activation="gelu_pytorch_tanh",
    )


def _llama3_scaling(factor: float, original_max_position_embeddings: int) -> RopeScaling:
    return RopeScaling("llama3", factor, 1.0, 4.0, original_max_position_embeddings)


PRESETS: dict[str, Preset] = {
    # A larger initializer range than the default 0.02 so that greedy output of a random model varies.
    "tiny": _preset("llama", 128, 4, 4, 2, 32, 344, 0, 2048, "float32", 0.08, _llama3_scaling(8.0, 256)),
    "llama-3.2-1b": _preset(
        "llama", 2048, 16, 32, 8, 64, 8192, 128256, 131072, "bfloat16", 0.02, _llama3_scaling(32.0, 8192)
    ),
    # Drafts for speculative decoding (worker/spec/draft_model.py): the shape above them with fewer, narrower
    # layers, the same vocabulary and tokenizer, so that scripts/train_synthetic.py (same seed) teaches both
    # the same language. llama-3.2-1b-draft: about 220M parameters, 197M of them the embedding and LM head.
    "tiny-draft": _preset("llama", 64, 2, 2, 1, 32, 172, 0, 2048, "float32", 0.08, _llama3_scaling(8.0, 256)),
    "llama-3.2-1b-draft": _preset(
        "llama", 768, 4, 12, 4, 64, 2048, 128256, 131072, "bfloat16", 0.02, _llama3_scaling(32.0, 8192)
    ),
    "llama-3-8b": _preset("llama", 4096, 32, 32, 8, 128, 14336, 128256, 8192, "bfloat16", 0.02),
    "qwen2-tiny": _preset("qwen2", 128, 4, 4, 2, 32, 344, 0, 2048, "float32", 0.08),
    # head_dim 64 with 4 heads: q_size (256) differs from hidden_size, as in the real Qwen3 shapes.
    "qwen3-tiny": _preset("qwen3", 128, 4, 4, 2, 64, 344, 0, 2048, "float32", 0.08, tie_word_embeddings=True),
    "qwen2.5-0.5b": _preset(
        "qwen2", 896, 24, 14, 2, 64, 4864, 151936, 32768, "bfloat16", 0.02, tie_word_embeddings=True
    ),
    "qwen3-0.6b": _preset(
        "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 40960, "bfloat16", 0.02, tie_word_embeddings=True
    ),
    # Phi-3: Llama's eps, RoPE theta 1e4, q/k/v and gate/up stored fused. phi3-tiny has Phi-3.5's longrope
    # (original length 256, the long factors past it) and Phi-4-mini's partial rotary factor.
    "phi3-tiny": replace(
        _preset("llama", 128, 4, 4, 2, 32, 344, 0, 2048, "float32", 0.08),
        model_type="phi3",
        rope_theta=1e4,
        rope_scaling=RopeScaling(
            "longrope",
            8.0,
            original_max_position_embeddings=256,
            short_factor=(1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0),
            long_factor=(1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0),
        ),
        partial_rotary_factor=0.5,
    ),
    # Phi-3-mini-4k-instruct's shape (head_dim 96, no GQA). Its config.json slides every layer over 2047
    # tokens; the preset has no window, so that benchmarks read the whole 4096-token context.
    "phi-3-mini": replace(
        _preset("llama", 3072, 32, 32, 32, 96, 8192, 32064, 4096, "bfloat16", 0.02),
        model_type="phi3",
        rope_theta=1e4,
    ),
    # Windows of 16 tokens, so that the tests' prompts and outputs run past them; query_pre_attn_scalar not
    # head_dim, as in Gemma-2-27B.
    "gemma2-tiny": _gemma_preset("gemma2", 128, 4, 4, 2, 32, 344, 0, 2048, "float32", 0.08, 16, 2, 48.0),
    "gemma3-tiny": _gemma_preset("gemma3_text", 128, 6, 4, 2, 64, 344, 0, 2048, "float32", 0.08, 16, 3, 48.0),
    "gemma-2-2b": _gemma_preset(
        "gemma2", 2304, 26, 8, 4, 256, 9216, 256000, 8192, "bfloat16", 0.02, 4096, 2, 256.0
    ),
    "gemma-2-9b": _gemma_preset(
        "gemma2", 3584, 42, 16, 8, 256, 14336, 256000, 8192, "bfloat16", 0.02, 4096, 2, 256.0
    ),
    "gemma-3-1b": _gemma_preset(
        "gemma3_text", 1152, 26, 4, 1, 256, 6912, 262144, 32768, "bfloat16", 0.02, 512, 6, 256.0
    ),
    "qwen3-moe-tiny": _preset(
        "qwen3_moe", 128, 4, 4, 2, 64, 344, 0, 2048, "float32", 0.08, experts=(8, 2, 96)
    ),
    # 30.5B parameters, 3.3B active: 61 GB in bfloat16 (128 experts of 3 x 768 x 2048 in each of 48 layers)
    "qwen3-30b-a3b": _preset(
        "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, 40960, "bfloat16", 0.02, experts=(128, 8, 768)
    ),
}


def _training_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))]


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained on the standard library, with Llama-3 special tokens at the end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    # Added after training so that they take the last ids, as in Llama 3.
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    force: bool = False,
    device: str = "cpu",
    weights: bool = True,
) -> Path:
    """Writes the checkpoint to `out_dir` and returns its path; does nothing if it already holds one.
    `device` is where the random weights are drawn: "cuda" makes an 8B checkpoint in seconds instead of
    many minutes on the CPU (other values than the CPU's for the same seed, as each device has its own
    generator). Without `weights`: config.json, generation_config.json and the tokenizer only, for the
    worker's --load-format dummy (which draws the weights itself)."""
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        return out
    p = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids("<|eot_id|>")]

    dtype = getattr(torch, p.dtype)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": p.rope_theta}
    if p.rope_scaling is not None:
        rope.update(_rope_parameters(p.rope_scaling))
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[p.model_type]
    # Qwen2's and Phi-3's configs have no head_dim (it is always hidden_size / num_heads there).
    extra: dict[str, Any] = {} if p.model_type in ("qwen2", "phi3") else {"head_dim": p.head_dim}
    if p.model_type == "phi3":  # the pretraining length at the top level, and the partial rotary factor
        scaling = p.rope_scaling
        original = scaling.original_max_position_embeddings if scaling else p.max_position_embeddings
        extra |= {"original_max_position_embeddings": original, "pad_token_id": None}
        rope["partial_rotary_factor"] = p.partial_rotary_factor
    if p.num_experts:
        extra.update(
            num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
            moe_intermediate_size=p.moe_intermediate_size, norm_topk_prob=p.norm_topk_prob,
        )  # fmt: skip
    family: dict = {}
    if p.model_type.startswith("gemma"):
        family = {
            "sliding_window": max(p.layer_windows),
            "layer_types": ["sliding_attention" if w else "full_attention" for w in p.layer_windows],
            "query_pre_attn_scalar": int(p.query_pre_attn_scalar),
            "attn_logit_softcapping": p.attn_logit_softcap or None,
            "final_logit_softcapping": p.final_logit_softcap or None,
            "hidden_activation": p.hidden_activation,
        }
        if p.model_type == "gemma3_text":  # RoPE per layer type
            local = {"rope_type": "default", "rope_theta": p.sliding_rope_theta}
            rope = {"full_attention": rope, "sliding_attention": local}  # type: ignore[dict-item]
    config = config_class(
        vocab_size=p.vocab_size or len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        **extra,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=p.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=p.tie_word_embeddings,
        initializer_range=p.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_ids[0],
        **family,
    )
    generation = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, do_sample=False)
    if not weights:  # what save_pretrained would write beside the weights
        config.architectures = [model_class.__name__]
        config.dtype = dtype
        config.save_pretrained(out)
        generation.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    # Built directly in the saved dtype so the large presets never hold a float32 copy.
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    with torch.no_grad():
        # Random norm gains keep activations from being identical across positions of a random model; random
        # biases (Qwen2's q/k/v) make a bias that is lost or misplaced change the output. Gemma's norms
        # scale by 1 + weight.
        gemma = p.model_type.startswith("gemma")
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    model.generation_config = generation
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write a random-weight Llama or Qwen checkpoint and its tokenizer."
    )
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda: much faster)")
    parser.add_argument(
        "--no-weights",
        dest="weights",
        action="store_false",
        help="write config.json, generation_config.json and the tokenizer only, in seconds: a model "
        "directory for the worker's --load-format dummy, which draws random weights of its shapes itself",
    )
    args = parser.parse_args()
    path = make_model(args.out, args.preset, args.seed, args.force, args.device, args.weights)
    print(path)


if __name__ == "__main__":
    main()
