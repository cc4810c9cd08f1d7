"""How many of a draft model's greedy tokens a target accepts under greedy verification, measured offline in
transformers: a check of a trained target and draft pair before any serving benchmark.

    python scripts/draft_agreement.py --model /tmp/m1b --draft /tmp/m1b-draft [--k 4] [--num-prompts 16]
        [--prompt-len 64] [--output-len 256] [--device cuda] [--out agreement.json]

The target continues each prompt greedily (`generate`); the draft reads the result in one forward pass and
predicts each next token. Under greedy verification a draft token is accepted while it equals the target's
token, and the draft then sees exactly the target's tokens, so the accepted length of a verification step at
position t is the run of positions from t where the draft's prediction equals the target's token, capped at
k; the next step starts past them and the target's own token. That is what the engine's draft proposer
(worker/spec/draft_model.py) and greedy verification give, without the engine. Prompts come from the
checkpoint's synthetic language (scripts/train_synthetic.py) when it has one, else random token ids.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scripts._bench import format_table, run_record, write_json  # noqa: E402
from scripts.train_synthetic import SyntheticLanguage  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the target checkpoint")
    p.add_argument("--draft", required=True, help="the draft checkpoint")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="where to write the results as JSON")
    return p.parse_args(argv)


def accepted_lengths(matches: np.ndarray, k: int) -> list[int]:
    """The accepted length of each greedy verification step over a continuation whose position i the
    draft predicts right where matches[i]."""
    lengths = []
    t = 0
    while t < len(matches):
        run = 0
        while run < k and t + run < len(matches) and matches[t + run]:
            run += 1
        lengths.append(run)
        t += run + 1  # the accepted drafts and the target's own token
    return lengths


def _load(path: str, device: str):  # -> PreTrainedModel
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # the continuation runs its full length
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def measure(args: argparse.Namespace) -> dict:
    target, draft = _load(args.model, args.device), _load(args.draft, args.device)
    rng = np.random.default_rng(args.seed)
    language = SyntheticLanguage.load(args.model)
    if language is not None:
        prompts = language.sample(rng, args.num_prompts, args.prompt_len)
    else:
        prompts = rng.integers(0, draft.config.vocab_size, (args.num_prompts, args.prompt_len))
    ids = torch.from_numpy(prompts).to(args.device)
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len, do_sample=False
    )
    predicted = draft(input_ids=out).logits.argmax(-1)  # [N, P + O]: position i predicts token i + 1
    start = args.prompt_len
    matches = (predicted[:, start - 1 : -1] == out[:, start:]).cpu().numpy()  # [N, O]
    lengths = [n for row in matches for n in accepted_lengths(row, args.k)]
    histogram = Counter(lengths)
    return {
        "k": args.k,
        "token_agreement": float(matches.mean()),
        "mean_accepted": float(np.mean(lengths)),
        "tokens_per_step": float(np.mean(lengths)) + 1.0,  # the accepted drafts and the target's own token
        "histogram": {str(n): histogram.get(n, 0) for n in range(args.k + 1)},
        "synthetic_language": language is not None,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = measure(args)
    print(f"target {args.model}, draft {args.draft}, k={args.k}, on {args.device}")
    print(
        f"the draft predicts the target's greedy token at {report['token_agreement']:.1%} of positions; "
        f"{report['mean_accepted']:.2f} drafts accepted a step, {report['tokens_per_step']:.2f} tokens a step"
    )
    steps = sum(report["histogram"].values())
    cells = [[n, str(c), f"{c / steps:.1%}"] for n, c in report["histogram"].items()]
    print(format_table(["accepted", "steps", "share"], cells))
    write_json(args.out, {**report, "record": run_record(__file__, argv)})
    return report


if __name__ == "__main__":
    main()
