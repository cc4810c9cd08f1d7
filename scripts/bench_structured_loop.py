"""Structured output's cost per step in an engine loop on the CPU: the real scheduler core and ModelRunner
in one process (tests/engine_loop.py), every request constrained by scripts/bench_schema.json.

    python scripts/bench_structured_loop.py [--requests 64] [--max-tokens 48] [--orders sync,worker]
        [--grammar-threads 0] [--repeats 3] [--out loop.json]

Each order runs with the masks filled ahead (`StructuredOutputs.fill_ahead`: a thread fills a step's rows'
next masks once its tokens reach the host, `prefill_after`) and without: `sync` runs one step at a
time (each step answered before the next plan is made), `worker` in the worker loop's order (step N+1's
forward queued, step N answered, step N+1's sampler). Per configuration: the loop's wall time (the grammar
compiles before it), and the medians over the steps of the worker's launch trace (worker/launch_trace.py):
the masks' cost to the sampler's launch (`launch_ms`: waiting for the masks filled in the background,
`wait_ms`, plus the host work left to the launch, `host_ms`, plus queuing the transfer), the background
fill's own time (`ahead_ms`), the share of rows whose masks were filled ahead (`reused`). The tiny test
checkpoint (scripts/make_model.py) with its 4,096-token tokenizer; CPU times are relative only (a shared
machine), the GPU's are `bench_throughput --step-trace`'s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts._bench import format_table, run_record, write_json  # noqa: E402


def run_once(model_dir: Path, order: str, ahead: bool, args: argparse.Namespace) -> dict[str, float]:
    from pagedserve.common.config import WorkerConfig
    from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
    from pagedserve.worker.model_runner import ModelRunner
    from tests.engine_loop import run_engine

    config = WorkerConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=2048,
        grammar_threads=args.grammar_threads,
    )  # fmt: skip
    runner = ModelRunner(config)
    runner.structured.fill_ahead = ahead
    runner.trace_launches = True
    spec = (Path(__file__).parent / "bench_schema.json").read_text()
    rng = random.Random(0)
    requests = [
        (
            [rng.randrange(1, 4000) for _ in range(rng.randint(8, 32))],
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=1.0,
                seed=i,
                ignore_eos=True,
                structured=StructuredOutput("json_schema", spec=spec),
            ),
        )  # fmt: skip
        for i in range(args.requests)
    ]
    splits: list[dict[str, float]] = []
    finish = runner.finish

    def traced_finish():
        out = finish()
        split = runner.launch_trace.take(out.step_id)
        if split.get("structured_rows"):
            splits.append(split)
        return out

    runner.finish = traced_finish
    runner.structured._compile(requests[0][1].structured).result()  # the compile is not timed
    started = time.perf_counter()
    run_engine(
        runner, requests, order == "worker", split_launch=order == "worker", max_steps=100000,
        max_num_seqs=args.requests, max_num_batched_tokens=4096,
    )  # fmt: skip
    wall = time.perf_counter() - started
    runner.close()

    def median(key: str) -> float:
        return statistics.median(s[key] for s in splits)

    return dict(
        wall_s=wall,
        steps=len(splits),
        # the sampler's launch: waiting for the masks, doing the rest, queuing the transfer
        launch_ms=statistics.median(
            s["structured_wait_ms"] + s["structured_host_ms"] + s["structured_copy_ms"] for s in splits
        ),
        wait_ms=median("structured_wait_ms"),
        host_ms=median("structured_host_ms"),
        ahead_ms=median("structured_ahead_ms"),
        accept_ms=median("structured_accept_ms"),
        fill_ms=median("structured_fill_ms"),
        reused=sum(s["structured_reused_rows"] for s in splits) / sum(s["structured_rows"] for s in splits),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--orders", default="sync,worker")
    p.add_argument("--grammar-threads", type=int, default=0, help="0: the worker's default")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternated")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from scripts.make_model import make_model

    model_dir = make_model(Path("/tmp/pagedserve-bench-tiny-llama"), preset="tiny", seed=0)
    rows = []
    for order in args.orders.split(","):
        results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.repeats):  # alternated, so that the machine's load drifts into both alike
            for ahead in (False, True):
                results[ahead].append(run_once(model_dir, order, ahead, args))
        for ahead, runs in results.items():
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append(dict(order=order, fill_ahead=ahead, **row))
    columns = ["order", "fill_ahead", "wall_s", "steps", "launch_ms", "wait_ms", "host_ms", "ahead_ms"]
    columns += ["accept_ms"]
    columns += ["fill_ms", "reused"]
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    print(format_table(columns, cells))
    write_json(args.out, {"runs": rows, "record": run_record(__file__)})


if __name__ == "__main__":
    main()
