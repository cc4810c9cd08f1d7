"""Encode and decode time of the per-step messages (common/messages.py), median of repeated runs.

    python scripts/bench_codec.py [--num-seqs 256] [--json-out FILE]

The scheduler encodes a StepPlan and decodes a StepOutput every step, the worker the other way round: both
sit on the path from one step to the next. The plan is a decode step of `--num-seqs` sequences with a few new
ones (200-token prompts) and some new blocks; the outputs carry one token per sequence, without and with five
top logprobs each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.common.messages import (  # noqa: E402
    Message,
    NewSequence,
    SamplingParams,
    StepOutput,
    StepPlan,
    TokenLogprobs,
    decode,
    encode,
)
from scripts._bench import format_table, time_repeats, write_json  # noqa: E402


def step_plan(num_seqs: int) -> StepPlan:
    new_seqs = [
        NewSequence(
            5000 + i,
            list(range(200)),
            list(range(13)),
            0,
            SamplingParams(temperature=0.7, top_p=0.9, top_k=40),
            99 + i,
        )
        for i in range(4)
    ]
    return StepPlan(
        step_id=12345,
        freed_seq_ids=[1000 + i for i in range(8)],
        new_seqs=new_seqs,
        new_block_ids=[(i, [i + 300]) for i in range(0, num_seqs, 16)],
        scheduled_seq_ids=list(range(num_seqs)),
        num_scheduled_tokens=[1] * num_seqs,
        sampling_seq_ids=list(range(num_seqs)),
    )


def step_output(num_seqs: int, num_logprobs: int) -> StepOutput:
    logprobs = [
        TokenLogprobs(-0.5, list(range(num_logprobs)), [-0.5 * (k + 1) for k in range(num_logprobs)])
        if num_logprobs
        else None
        for _ in range(num_seqs)
    ]
    return StepOutput(
        12345, list(range(num_seqs)), [30000 + i for i in range(num_seqs)], logprobs, 0.0042, 0.0001
    )


def median_us(fn: Callable[[], object], number: int = 2000, repeat: int = 15) -> float:
    return time_repeats(fn, repeat, number).median * 1e6


def main(argv: list[str] | None = None) -> list[dict[str, float | int | str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    n = args.num_seqs
    cases: list[tuple[str, Message]] = [
        (f"StepPlan, {n} sequences", step_plan(n)),
        (f"StepOutput, {n} tokens", step_output(n, 0)),
        (f"StepOutput, {n} tokens + 5 logprobs", step_output(n, 5)),
    ]
    rows: list[dict[str, float | int | str]] = []
    for name, msg in cases:
        frames = encode(msg)
        assert decode(frames) == msg
        row = {
            "message": name,
            "bytes": len(frames[1]),
            "encode_us": round(median_us(lambda msg=msg: encode(msg)), 2),
            "decode_us": round(median_us(lambda frames=frames: decode(frames)), 2),
        }
        rows.append(row)
    cells = [[r["message"], str(r["bytes"]), f"{r['encode_us']:.2f}", f"{r['decode_us']:.2f}"] for r in rows]
    print(format_table(["message", "bytes", "encode us", "decode us"], cells))
    write_json(args.json_out, rows)
    return rows


if __name__ == "__main__":
    main()
