"""Median time of one sampler call on a whole batch, per kind of batch, on the best device present.

    python scripts/bench_sampler.py [--batch 256] [--vocab 128256] [--iters 20] [--out sampler.json]

`sample()` is the compatibility entry (rows built into tensors, drawn, copied back, unpacked); `prepared`
times `sample_tensors(...).start_copy().wait()` with the SamplingTensors built beforehand, as the model
runner can do before its forward pass. Both include the wait for the device and the one copy of the results.

The second table is the per-step cost of the logits processors (worker/logits_processors.py) at batch sizes
up to --batch: a top-p=0.9 step as the model runner does it (columns from the sequences, the draw, the copy
back) against the same step with presence, frequency and repetition penalties and min_p on every sequence,
and with 16 logit_bias entries besides; each sequence has a 512-token prompt and 512 generated tokens.

`--compare` (issue 22's goal) times one step of plain temperature-1 sampling against the same step with
presence, frequency and repetition penalties, top_p 0.9 and min_p 0.05 on every sequence, at batch 256 and
512 (`--compare-batches`), "before" (the full stable sort for top-p, the PyTorch penalties and min_p: what
the CPU still runs) and "after" (on CUDA: kernels/nucleus.py's rejection draw, kernels/processors.py). On the
CPU "after" is the same code as "before"; there the `draw` rows time the top-p draw alone, the sort against
the rejection rounds' PyTorch reference, for their relative cost.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.common.messages import SamplingParams  # noqa: E402
from pagedserve.kernels import reference_processors  # noqa: E402
from pagedserve.kernels.reference_nucleus import draw_nucleus_reference  # noqa: E402
from pagedserve.worker import sampler as worker_sampler  # noqa: E402
from pagedserve.worker.logits_processors import LogitsProcessors  # noqa: E402
from pagedserve.worker.nucleus_draw import round_uniforms_for  # noqa: E402
from pagedserve.worker.sampler import SamplingRow, SamplingTensors, sample, sample_tensors, uniforms_for  # noqa: E402
from scripts._bench import format_table, run_record, time_repeats, write_json  # noqa: E402


def _row(
    temperature: float, top_k: int, top_p: float, seed: int, position: int, num_logprobs: int
) -> SamplingRow:
    logprobs = None if num_logprobs < 0 else num_logprobs
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
    return SamplingRow(params, seed, position)


CASES: dict[str, Callable[[random.Random], SamplingRow]] = {
    "greedy": lambda rng: _row(0.0, 0, 1.0, rng.randrange(2**63), rng.randrange(4096), -1),
    "temperature": lambda rng: _row(0.8, 0, 1.0, rng.randrange(2**63), rng.randrange(4096), -1),
    "top_k=50": lambda rng: _row(0.8, 50, 1.0, rng.randrange(2**63), rng.randrange(4096), -1),
    "top_p=0.9": lambda rng: _row(0.8, 0, 0.9, rng.randrange(2**63), rng.randrange(4096), -1),
    "mixed+logprobs": lambda rng: _row(
        rng.choice([0.0, 0.8]),
        rng.choice([0, 20, 50]),
        rng.choice([1.0, 1.0, 0.95]),
        rng.randrange(2**63),
        rng.randrange(4096),
        rng.choice([-1, -1, 5]),
    ),
}


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05)
PROCESSOR_CASES: dict[str, dict] = {
    "top_p=0.9": {},
    "+penalties+min_p": PENALTIES,
    "+penalties+min_p+logit_bias": {**PENALTIES, "logit_bias": tuple((t * 37, 1.5) for t in range(16))},
}


class _Seq:
    """What the processors read of a worker sequence."""

    def __init__(self, params: SamplingParams, token_ids: list[int], prompt_len: int) -> None:
        self.params, self.token_ids, self.prompt_len, self.pending = params, token_ids, prompt_len, 0
        self.processed = params.processed


def processor_step(
    logits: torch.Tensor, seqs: list[_Seq], processors: LogitsProcessors, device: torch.device
) -> None:
    """One step's sampling as the model runner does it: columns, processors, draw, copy back."""
    n = len(seqs)
    position = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
    tensors = SamplingTensors.from_params(
        [s.params for s in seqs],
        seed=np.arange(n, dtype=np.uint64),
        position=position,
        device=device,
        processors=processors.prepare(seqs, position),
    )
    sample_tensors(logits, tensors).start_copy().wait()


def processor_results(args: argparse.Namespace, logits: torch.Tensor, device: torch.device) -> list[dict]:
    results = []
    batches = [b for b in (1, 16, 64, 256) if b < args.batch] + [args.batch]
    for batch in batches:
        plain_ms = 0.0
        for name, fields in PROCESSOR_CASES.items():
            rng = random.Random(0)
            params = SamplingParams(temperature=0.8, top_p=0.9, **fields)
            seqs = [_Seq(params, [rng.randrange(args.vocab) for _ in range(1024)], 512) for _ in range(batch)]
            processors = LogitsProcessors(args.vocab, (0,), device)
            rows = logits[:batch]
            processor_step(rows, seqs, processors, device)  # fills the token histories once
            step = lambda rows=rows, seqs=seqs, processors=processors: processor_step(  # noqa: E731
                rows, seqs, processors, device
            )
            ms = median_seconds(step, args.iters, device) * 1e3
            position = np.full(batch, 1024, dtype=np.int64)
            prepare = lambda seqs=seqs, processors=processors, position=position: processors.prepare(  # noqa: E731
                seqs, position
            )
            host_ms = median_seconds(prepare, args.iters, device) * 1e3
            plain_ms = plain_ms or ms
            overhead = 100 * (ms / plain_ms - 1)
            results.append(
                {"batch": batch, "case": name, "step_ms": ms, "prepare_ms": host_ms, "overhead_pct": overhead}
            )
    return results


@contextmanager
def legacy_paths(device: torch.device) -> Iterator[None]:
    """The sampler as before issue 22's kernels: the full sort for top-p, the PyTorch penalties and min_p."""
    if device.type != "cuda":  # the CPU runs those anyway
        yield
        return
    from pagedserve.kernels import processors as kernel_rules

    saved = kernel_rules.penalize_, kernel_rules.min_p_, worker_sampler.device_round_uniforms
    kernel_rules.penalize_, kernel_rules.min_p_ = reference_processors.penalize_, reference_processors.min_p_
    worker_sampler.device_round_uniforms = lambda *args, **kwargs: None
    try:
        yield
    finally:
        kernel_rules.penalize_, kernel_rules.min_p_, worker_sampler.device_round_uniforms = saved


COMPARE_CASES: dict[str, dict] = {
    "plain T=1": {},
    "penalties+top_p+min_p": dict(
        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, top_p=0.9, min_p=0.05
    ),
}


def draw_results(args: argparse.Namespace, rows: torch.Tensor, device: torch.device) -> list[dict]:
    """The top-p draw alone: the sort against the rejection rounds (reference on the CPU, kernel on CUDA)."""
    results = []
    batch = n = len(rows)
    scaled = rows.float()
    seed, position = np.arange(n, dtype=np.uint64), np.full(n, 1024)
    uniforms = torch.from_numpy(round_uniforms_for(uniforms_for, seed, position)).to(device)
    with legacy_paths(device):  # the tensors too: on CUDA they would carry the rejection rounds' uniforms
        tensors = SamplingTensors.from_params(
            [SamplingParams(temperature=1.0, top_p=0.9)] * n, seed, position, device
        )
        sort_ms = median_seconds(lambda: sample_tensors(scaled, tensors).tokens, args.iters, device)
    args_ = (scaled, torch.arange(n, device=device), torch.ones(n, device=device))
    args_ += (
        torch.zeros(n, dtype=torch.int64, device=device),
        torch.full((n,), 0.9, device=device),
        uniforms,
    )
    ref_ms = median_seconds(lambda: draw_nucleus_reference(*args_), args.iters, device)
    results.append(
        {"batch": batch, "version": "draw", "case": "top_p=0.9 full sort", "step_ms": sort_ms * 1e3}
    )
    results.append({"batch": batch, "version": "draw", "case": "top_p=0.9 rejection (PyTorch reference)",
                    "step_ms": ref_ms * 1e3})  # fmt: skip
    if device.type == "cuda":
        from pagedserve.kernels.nucleus import draw_nucleus

        kernel_ms = median_seconds(lambda: draw_nucleus(*args_), args.iters, device)
        results.append({"batch": batch, "version": "draw", "case": "top_p=0.9 rejection (Triton)",
                        "step_ms": kernel_ms * 1e3})  # fmt: skip
    return results


def compare_results(args: argparse.Namespace, logits: torch.Tensor, device: torch.device) -> list[dict]:
    """Issue 22's goal per step: each case before and after, and its ratio to plain sampling's time."""
    results = []
    for batch in args.compare_batches:
        rows = logits[:batch]
        plain_ms = {}
        for version in ("before", "after"):
            for name, fields in COMPARE_CASES.items():
                rng = random.Random(0)
                params = SamplingParams(temperature=1.0, **fields)
                seqs = [
                    _Seq(params, [rng.randrange(args.vocab) for _ in range(1024)], 512) for _ in range(batch)
                ]
                processors = LogitsProcessors(args.vocab, (0,), device)
                step = lambda rows=rows, seqs=seqs, processors=processors: processor_step(  # noqa: E731
                    rows, seqs, processors, device
                )
                if version == "before":
                    with legacy_paths(device):
                        ms = median_seconds(step, args.iters, device) * 1e3
                else:
                    ms = median_seconds(step, args.iters, device) * 1e3
                plain_ms.setdefault(version, ms)
                results.append(
                    {"batch": batch, "version": version, "case": name, "step_ms": ms,
                     "vs_plain": plain_ms[version] / ms}
                )  # fmt: skip
        results += draw_results(args, rows, device)
    return results


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return time_repeats(fn, iters, sync=sync).median


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="where to write the results as JSON")
    parser.add_argument("--compare", action="store_true", help="only issue 22's before/after table")
    parser.add_argument(
        "--compare-batches", type=lambda s: [int(b) for b in s.split(",")], default=[256, 512]
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_rows = max(args.batch, *args.compare_batches) if args.compare else args.batch
    logits = (torch.randn(num_rows, args.vocab, device=device) * 3).to(dtype)
    if args.compare:
        print(f"vocab {args.vocab}, {dtype}, on {device}")
        results = compare_results(args, logits, device)
        cells = [
            [str(r["batch"]), r["version"], r["case"], f"{r['step_ms']:.3f}",
             f"{r['vs_plain']:.3f}" if "vs_plain" in r else ""]
            for r in results
        ]  # fmt: skip
        print(format_table(["batch", "version", "case", "step ms", "plain / case"], cells))
        report = {"vocab": args.vocab, "dtype": str(dtype), "device": str(device), "compare": results}
        write_json(args.out, {**report, "record": run_record(__file__)})
        return

    results = []
    print(f"batch {args.batch} x vocab {args.vocab}, {dtype}, on {device}")
    for name, make_row in CASES.items():
        rng = random.Random(0)
        rows = [make_row(rng) for _ in range(args.batch)]
        tensors = SamplingTensors.from_rows(rows, device)
        plain = median_seconds(lambda rows=rows: sample(logits, rows), args.iters, device)
        prepared = median_seconds(
            lambda tensors=tensors: sample_tensors(logits, tensors).start_copy().wait(), args.iters, device
        )
        results.append({"case": name, "sample_ms": plain * 1e3, "prepared_ms": prepared * 1e3})
    cells = [[r["case"], f"{r['sample_ms']:.3f}", f"{r['prepared_ms']:.3f}"] for r in results]
    print(format_table(["case", "sample() ms", "prepared ms"], cells))
    processors = processor_results(args, logits, device)
    cells = [
        [
            str(r["batch"]),
            r["case"],
            f"{r['step_ms']:.3f}",
            f"{r['overhead_pct']:+.1f}%",
            f"{r['prepare_ms']:.3f}",
        ]
        for r in processors
    ]
    print(format_table(["batch", "logits processors", "step ms", "vs top_p", "host prepare ms"], cells))
    report = {"batch": args.batch, "vocab": args.vocab, "dtype": str(dtype), "device": str(device)}
    record = run_record(__file__)
    write_json(args.out, {**report, "results": results, "processors": processors, "record": record})


if __name__ == "__main__":
    main()
