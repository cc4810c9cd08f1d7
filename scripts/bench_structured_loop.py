"""Structured output's cost per step in an engine loop on the CPU: the real scheduler core and ModelRunner
in one process (tests/engine_loop.py), every request constrained by scripts/bench_schema.json.

    python scripts/bench_structured_loop.py [--requests 64] [--max-tokens 48] [--orders sync,worker]
        [--grammar-threads 0] [--repeats 3] [--out loop.json]

Each order runs with the masks filled ahead of the plan (`StructuredOutputs.fill_ahead`) and without:
`sync` runs one step at a time (each step answered before the next plan is made: the rows fill ahead of
it), `worker` in the worker loop's order (step N+1's forward queued, step N answered, step N+1's sampler:
the rows fill behind step N+1's forward). Per configuration: the loop's wall time, and the medians over the
steps of the worker's launch trace (worker/launch_trace.py): how long the sampler's launch waited for the
masks filled in the background (`wait_ms`), the host work left to the launch (`host_ms`), the share of
rows whose masks were filled ahead. The tiny test checkpoint (scripts/make_model.py) with its 4,096-token
tokenizer; CPU times are relative only (a shared machine), the GPU's are `bench_throughput --step-trace`'s.
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
    from common.config import WorkerConfig
    from common.sampling_params import SamplingParams, StructuredOutput
    from tests.engine_loop import run_engine
    from worker.model_runner import ModelRunner

    config = WorkerConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=2048
    )
    runner = ModelRunner(config)
    if args.grammar_threads:
        from worker.grammar_batch import GrammarBatch

        runner.structured.batch.close()
        runner.structured.batch = GrammarBatch(args.grammar_threads)
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
    columns = ["order", "fill_ahead", "wall_s", "steps", "wait_ms", "host_ms", "ahead_ms", "accept_ms"]
    columns += ["fill_ms", "reused"]
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    print(format_table(columns, cells))
    write_json(args.out, {"runs": rows, "record": run_record(__file__)})


if __name__ == "__main__":
    main()
