"""Trains a checkpoint in place on a small synthetic language, so that its next-token distributions are as
peaked as a real model's: random weights give near-uniform logits, where every greedy step is a near-tie
that bf16 rounding (in any implementation) decides, which makes a greedy-identity check meaningless.

    python scripts/train_synthetic.py --model /tmp/m1b --device cuda [--steps 300]

The language (`SyntheticLanguage`): 512 token ids of the vocabulary (no special tokens); after tokens a, b
the next token is succ[half(a), b] with probability 0.9 (half(a): whether a is in the first or the second
half of the subset, so the rule needs the token before the current one, i.e. attention), else a uniformly
random subset token. It is written to `synthetic_language.json` in the checkpoint, with the training's
final loss and the greedy rule accuracy on fresh sequences; `scripts/check_correctness.py` draws its
prompts from it when it is there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import numpy as np  # noqa: E402
import torch  # noqa: E402

LANGUAGE_FILE = "synthetic_language.json"


@dataclass(frozen=True)
class SyntheticLanguage:
    token_ids: list[int]  # the subset of the vocabulary, in index order
    succ: list[list[int]]  # [2][len(token_ids)] index of the likely next token, by half(previous), current
    p_rule: float  # probability that the next token follows the rule

    @classmethod
    def make(cls, vocab_size: int, special: set[int], seed: int, size: int = 512) -> SyntheticLanguage:
        rng = np.random.default_rng(seed)
        candidates = np.array([t for t in range(vocab_size) if t not in special])
        size = min(size, len(candidates) // 2)
        token_ids = rng.choice(candidates, size=size, replace=False)
        succ = [rng.permutation(size).tolist() for _ in range(2)]
        return cls([int(t) for t in token_ids], succ, 0.9)

    @classmethod
    def load(cls, model_dir: str | Path) -> SyntheticLanguage | None:
        path = Path(model_dir) / LANGUAGE_FILE
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return cls(d["token_ids"], d["succ"], d["p_rule"])

    def sample(self, rng: np.random.Generator, num: int, length: int) -> np.ndarray:
        """[num, length] token ids: sentences of the language."""
        size = len(self.token_ids)
        succ = np.array(self.succ)
        idx = np.empty((num, length), dtype=np.int64)
        idx[:, :2] = rng.integers(size, size=(num, 2))
        follow = rng.random((num, length)) < self.p_rule
        noise = rng.integers(size, size=(num, length))
        for t in range(2, length):
            ruled = succ[(idx[:, t - 2] >= size // 2).astype(np.int64), idx[:, t - 1]]
            idx[:, t] = np.where(follow[:, t], ruled, noise[:, t])
        return np.array(self.token_ids)[idx]

    def likely_next(self, ids: np.ndarray) -> np.ndarray:  # [num, length] -> [num, length - 2] token ids
        index_of = {t: i for i, t in enumerate(self.token_ids)}
        idx = np.vectorize(index_of.__getitem__)(ids)
        size = len(self.token_ids)
        ruled = np.array(self.succ)[(idx[:, :-2] >= size // 2).astype(np.int64), idx[:, 1:-1]]
        return np.array(self.token_ids)[ruled]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory, rewritten in place")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=384, help="covers check_correctness' prompts + outputs")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    saved_dtype = AutoConfig.from_pretrained(args.model).dtype  # loading in float32 rewrites the config's
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    ids: list[object] = [model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id]
    if (Path(args.model) / "generation_config.json").exists():  # generate (and the engine) stop at these too
        ids.append(GenerationConfig.from_pretrained(args.model).eos_token_id)
    special = {t for v in ids for t in (v if isinstance(v, list) else [v]) if t is not None}
    language = SyntheticLanguage.make(model.config.vocab_size, special, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    autocast = args.device.startswith("cuda")
    model.train()
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        batch = torch.from_numpy(language.sample(rng, args.batch_size, args.seq_len)).to(args.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    ids = language.sample(np.random.default_rng(args.seed + 2), 8, args.seq_len)
    with torch.inference_mode():
        logits = model(input_ids=torch.from_numpy(ids).to(args.device)).logits.float()
    predicted = logits[:, 1:-1].argmax(-1).cpu().numpy()
    accuracy = float((predicted == language.likely_next(ids)).mean())
    model.to(saved_dtype).save_pretrained(args.model)
    report = {
        **asdict(language),
        "train": {
            "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
            "final_loss": round(loss.item(), 4), "greedy_rule_accuracy": round(accuracy, 4),
            "seconds": round(time.perf_counter() - start, 1), "device": args.device,
        },
    }  # fmt: skip
    (Path(args.model) / LANGUAGE_FILE).write_text(json.dumps(report))
    print(f"final loss {loss.item():.3f}, greedy follows the rule at {accuracy:.1%} of positions")
    return report


def main(argv: list[str] | None = None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
