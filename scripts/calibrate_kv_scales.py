"""Per-layer K and V scales for an FP8 KV cache, measured on calibration prompts and written into a copy of
the checkpoint, where the worker reads them (`--kv-cache-dtype fp8`).

    python scripts/calibrate_kv_scales.py --model DIR --out DIR-kv-scales [--prompts prompts.txt]

Each layer's scale is the largest |K| (|V|) the layer wrote into the cache over the prompts, over 448 (the
largest e4m3 value), so the largest value seen is stored as 448 and everything else keeps its relative
precision. Without scales an FP8 cache stores values as they are: above 448 they saturate, below 2^-6
they lose precision, below 2^-10 they round to zero. K is measured as the cache stores it: after the q/k
norms (Qwen3) and RoPE. The prompts run through the engine's own model, one prefill each, with a
full-precision cache.

Prompts: a text file with one prompt per line, tokenized with the checkpoint's tokenizer; without one,
random token ids (enough for random-weight checkpoints; a real model should see text like its traffic).
The scales go into `kv_scales.safetensors` beside the weights, as `model.layers.N.self_attn.k_scale` /
`v_scale` (one float32 each, the FP8 checkpoint convention), added to the index where the checkpoint has one.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.common.config import WorkerConfig  # noqa: E402
from pagedserve.kernels.reference import FP8_MAX  # noqa: E402
from pagedserve.worker.loader import (  # noqa: E402
    KV_SCALE_NAMES,
    checkpoint_tensor_names,
    load_model_config,  # noqa: E402
)
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402
from scripts.check_correctness import engine_logits  # noqa: E402

SCALES_FILE = "kv_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", required=True, help="where the checkpoint with scales goes (--model: in place)")
    p.add_argument("--prompts", default=None, help="text file, one calibration prompt per line")
    p.add_argument("--num-prompts", type=int, default=16, help="random prompts when there is no --prompts")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens of each random prompt")
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=2048,
        help="longer prompts are cut here (and at the model's limit)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="the model's compute dtype (auto: as the worker picks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the scales and the amax seen as JSON")
    return p.parse_args(argv)


def load_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    if args.prompts is None:
        rng = random.Random(args.seed)
        return [[rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lines = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [ids for ids in (tokenizer(line)["input_ids"] for line in lines) if ids]  # main() cuts them
    if not prompts:
        raise ValueError(f"{args.prompts}: no prompts (one per line)")
    return prompts


def measure_kv_amax(runner: ModelRunner, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """The largest |K| and |V| each layer writes into the cache over `prompts` (one prefill each)."""
    layers = runner.model.layers
    amax = [[0.0, 0.0] for _ in layers]
    originals = []
    for i, layer in enumerate(layers):
        attention = layer.self_attn
        project = attention.project
        originals.append((attention, project))

        def recording(positions: Any, hidden: Any, rope: Any, i: int = i, project: Any = project) -> Any:
            q, k, v = project(positions, hidden, rope)
            amax[i][0] = max(amax[i][0], k.detach().abs().amax().float().item())
            amax[i][1] = max(amax[i][1], v.detach().abs().amax().float().item())
            return q, k, v

        attention.project = recording
    try:
        for prompt in prompts:
            engine_logits(runner, prompt)
    finally:
        for attention, project in originals:
            attention.project = project
    return [(k, v) for k, v in amax]


def scales_from_amax(amax: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """amax / 448 per layer, K and V; 1.0 where a layer wrote only zeros."""
    return [tuple(a / FP8_MAX if a > 0 else 1.0 for a in pair) for pair in amax]  # type: ignore[misc]


def _refuse_calibrated(model_dir: Path) -> None:
    existing = [name for name in checkpoint_tensor_names(model_dir) if name.endswith(KV_SCALE_NAMES)]
    if existing:
        raise ValueError(f"{model_dir} already has KV scales ({existing[0]}, ...): calibrate the original")


def write_scales(model_dir: Path, out: Path, scales: list[tuple[float, float]]) -> Path:
    """Copies the checkpoint to `out` (unless it is the same directory) and adds the scales to it."""
    from safetensors.torch import save_file

    _refuse_calibrated(model_dir)
    if out.resolve() != model_dir.resolve():
        if out.exists():
            raise FileExistsError(f"{out} exists")
        shutil.copytree(model_dir, out)
    tensors = {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(value, dtype=torch.float32)
        for i, pair in enumerate(scales)
        for kv, value in zip("kv", pair, strict=True)
    }
    save_file(tensors, str(out / SCALES_FILE), metadata={"format": "pt"})
    index = out / INDEX_FILE
    if index.is_file():  # the loader reads the files the index names: name this one too
        data = json.loads(index.read_text())
        data["weight_map"].update({name: SCALES_FILE for name in tensors})
        index.write_text(json.dumps(data, indent=2))
    return out / SCALES_FILE


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, out = Path(args.model), Path(args.out)
    model_cfg = load_model_config(model_dir)
    _refuse_calibrated(model_dir)  # before the calibration run, not after it
    limit = min(args.max_prompt_len, model_cfg.max_position_embeddings)
    prompts = [prompt[:limit] for prompt in load_prompts(args, model_cfg.vocab_size)]
    longest = max(map(len, prompts))
    block_size = 16
    config = WorkerConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype, kv_cache_dtype="auto", max_num_seqs=1,
        block_size=block_size, max_model_len=longest, num_kv_blocks=-(-longest // block_size),
        swap_space=0.0, enforce_eager=True, piecewise_graphs=False,
    )  # fmt: skip
    runner = ModelRunner(config)
    amax = measure_kv_amax(runner, prompts)
    scales = scales_from_amax(amax)
    path = write_scales(model_dir, out, scales)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; scales written to {path}")
    print("layer  amax K      amax V      k_scale     v_scale")
    for i, ((ak, av), (sk, sv)) in enumerate(zip(amax, scales, strict=True)):
        print(f"{i:5d}  {ak:10.4g}  {av:10.4g}  {sk:10.4g}  {sv:10.4g}")
    report = {
        "model": str(model_dir), "out": str(out), "prompts": args.prompts or "random token ids",
        "num_prompts": len(prompts), "tokens": sum(map(len, prompts)),
        "amax": [list(pair) for pair in amax], "scales": [list(pair) for pair in scales],
    }  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
