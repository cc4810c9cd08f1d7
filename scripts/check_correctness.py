"""Greedy outputs of the engine against transformers on the same checkpoint, and its logits against a float32
reference: the correctness report of a GPU (or CPU) run.

    python scripts/check_correctness.py --model /tmp/m1b --device cuda [--num-prompts 32] [--max-tokens 64]
        [--json-out FILE]

Prompts of uniform lengths (`--min-prompt-len`..`--max-prompt-len`; random token ids, or sentences of the
checkpoint's synthetic language when `scripts/train_synthetic.py` trained it) run through the scheduler core
and the worker's ModelRunner (every prompt batched together, CUDA graphs and the Triton kernels on CUDA) in
`--dtype` (bf16 on CUDA), greedy, up to `--max-tokens` tokens each (both stop at the model's EOS).
transformers' `generate` runs each prompt alone in the same dtype. Reported:
- the fraction of sequences identical for all `--max-tokens` tokens (and, as the noise floor, how many of
  transformers' own `--dtype` outputs match its float32 greedy outputs), and for those that differ, where they
  first differ and the float32 reference's logprob gap between the two tokens there (a near-tie, where bf16
  rounding in either implementation may pick either token, has a small gap);
- the largest absolute difference between the engine's logits (one prefill of prompt + its generated tokens,
  through the paged KV cache) and transformers' float32 logits on the same tokens, over every position and
  vocabulary entry, and the same for transformers in `--dtype` (how far the dtype alone moves them).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedserve.common.messages import SamplingParams, SubmitRequest  # noqa: E402
from pagedserve.worker.inputs import build_inputs  # noqa: E402
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.worker.sequences import BlockTableArray  # noqa: E402
from scripts._bench import add_worker_flags, in_process_scheduler, run_record, worker_config, write_json  # noqa: E402
from scripts.train_synthetic import SyntheticLanguage  # noqa: E402

# The worker's own flags (--dtype auto: bfloat16 on cuda, float32 on cpu; --kv-cache-dtype fp8; ...).
WORKER_FLAGS = ("model", "device", "dtype", "fused_ops", "kv_cache_dtype")


# transformers' eager attention: its SDPA path leaves out Gemma 2's attention soft-cap (a 0.29 logit
# difference on a tiny model), which would make the reference wrong, not the engine
EAGER = {"attn_implementation": "eager"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add_worker_flags(p, WORKER_FLAGS, required=("model",), device=device)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def engine_greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt's greedy tokens, all prompts batched by the scheduler core."""
    scheduler = in_process_scheduler(runner, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        assert scheduler.add_request(b"check", SubmitRequest(str(i), prompt, params)) is None
    tokens: list[list[int]] = [[] for _ in prompts]
    while scheduler.has_work:
        for _, out in scheduler.update(runner.execute(scheduler.schedule())):
            tokens[int(out.request_id)].extend(out.token_ids)
    return tokens


@torch.inference_mode()
def engine_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:  # [T, V] float32
    """The engine's logits at every position of `token_ids`: one prefill through the paged KV cache (the
    pool's first blocks, free once the greedy run is over)."""
    bs = runner.block_size
    tables = BlockTableArray(runner.tables.max_blocks_per_seq, initial_rows=1)
    row = tables.add(list(range(-(-len(token_ids) // bs))))
    inputs = build_inputs(
        tables, np.array([row]), np.array([0]), np.array([len(token_ids)]), np.array(token_ids), bs
    )
    ids, positions, meta = runner._to_device(inputs)
    hidden = runner.model(ids, positions, meta, runner.kv.layers)
    return runner.model.compute_logits(hidden).float()


@torch.inference_mode()
def reference_greedy(model: Any, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def reference_logits(model: Any, token_ids: list[int], device: str) -> torch.Tensor:  # [T, V] float32
    return model(torch.tensor([token_ids], device=device)).logits[0].float()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    config = worker_config(
        args, WORKER_FLAGS, max_num_seqs=args.num_prompts, gpu_memory_utilization=0.5,
        max_model_len=args.max_prompt_len + args.max_tokens,
    )  # fmt: skip
    backend = "triton" if args.device.startswith("cuda") else "torch"
    runner = ModelRunner(config, attention_backend=backend)
    lengths = [rng.randint(args.min_prompt_len, args.max_prompt_len) for _ in range(args.num_prompts)]
    language = SyntheticLanguage.load(args.model)
    if language is None:  # random weights: random token ids
        prompts = [[rng.randrange(runner.vocab_size) for _ in range(n)] for n in lengths]
    else:  # trained by scripts/train_synthetic.py: prompts in its language
        sampled = language.sample(np.random.default_rng(args.seed), args.num_prompts, max(lengths))
        prompts = [row[:n].tolist() for row, n in zip(sampled, lengths, strict=True)]
    ours = engine_greedy(runner, prompts, args.max_tokens)

    same_dtype = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **EAGER).to(args.device).eval()
    theirs = [reference_greedy(same_dtype, p, args.max_tokens, args.device) for p in prompts]
    fp32 = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **EAGER).to(args.device).eval()
    )
    # The noise floor: how often transformers in --dtype itself matches its own float32 greedy output.
    exact_greedy = [reference_greedy(fp32, p, args.max_tokens, args.device) for p in prompts]

    divergences = []
    max_diff_engine = max_diff_same_dtype = 0.0
    for i, (prompt, mine, ref) in enumerate(zip(prompts, ours, theirs, strict=True)):
        sequence = prompt + mine
        exact = reference_logits(fp32, sequence, args.device)
        max_diff_engine = max(max_diff_engine, (engine_logits(runner, sequence) - exact).abs().max().item())
        low = reference_logits(same_dtype, sequence, args.device)
        max_diff_same_dtype = max(max_diff_same_dtype, (low - exact).abs().max().item())
        if mine != ref:
            k = next((j for j, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), None)
            if k is None:  # one stopped (EOS) where the other went on: not a token choice to weigh
                divergences.append({"prompt": i, "first_difference": min(len(mine), len(ref))})
                continue
            logprobs = torch.log_softmax(exact[len(prompt) + k - 1], dim=-1)
            gap = abs(logprobs[mine[k]] - logprobs[ref[k]]).item()
            divergences.append({"prompt": i, "first_difference": k, "float32_logprob_gap": round(gap, 5)})

    identical = args.num_prompts - len(divergences)
    floor = sum(a == b for a, b in zip(theirs, exact_greedy, strict=True))
    engine_exact = sum(a == b for a, b in zip(ours, exact_greedy, strict=True))
    report = {
        "record": run_record(__file__, argv),
        "model": str(Path(args.model).resolve().name),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "fused_ops": config.resolved_fused_ops,
        "kv_cache_dtype": config.resolved_kv_cache_dtype,
        "prompts": "random token ids" if language is None else "synthetic language (trained checkpoint)",
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "identical": identical,
        "identical_fraction": round(identical / args.num_prompts, 4),
        "transformers_dtype_identical_to_float32": floor,
        "engine_identical_to_transformers_float32": engine_exact,
        "divergences": divergences,
        "max_logit_diff_engine_vs_float32": round(max_diff_engine, 5),
        "max_logit_diff_transformers_same_dtype_vs_float32": round(max_diff_same_dtype, 5),
    }
    print(
        f"{report['model']} {args.dtype} on {report['device']}: {identical}/{args.num_prompts} sequences "
        f"identical to transformers for {args.max_tokens} tokens ({report['prompts']}); against transformers "
        f"float32: engine {engine_exact}, transformers {args.dtype} {floor}"
    )
    for d in divergences:
        gap = d.get("float32_logprob_gap")
        print(
            f"  prompt {d['prompt']}: first differs at token {d['first_difference']}"
            + ("" if gap is None else f", float32 logprob gap {gap:.4f}")
        )
    print(
        f"largest logit difference against float32: engine {max_diff_engine:.4f}, "
        f"transformers {args.dtype} {max_diff_same_dtype:.4f}"
    )
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
