"""KV sharing: a shared system prompt with prefix caching on against off, and parallel sampling (n
sequences in one request) against n independent requests.

    python scripts/bench_sharing.py --model /tmp/m1b --device cuda --json-out sharing.json
    python scripts/bench_sharing.py --device cpu --prefix-requests 8 --prefix-len 128 --prefix-output-len 8 \
        --parallel-prompts 2 --parallel-prompt-len 100 --parallel-output-len 16 --num-kv-blocks 256

Part `prefix`: --prefix-requests prompts, each one --prefix-len-token system prompt followed by a distinct
question of --min-question-len to --max-question-len tokens, each generating --prefix-output-len tokens,
all sent at once (or as a Poisson process of --request-rate per second). Runs `prefix-on` and `prefix-off`
each start a scheduler + worker, with --enable-prefix-caching and --no-enable-prefix-caching. TTFT is
from submitting to the first token through the ZeroMQ client, which streams every step's tokens.

Part `parallel`: --parallel-prompts prompts of --parallel-prompt-len tokens, each sampled --parallel-n
times at --temperature with seeds. Run `parallel-n4` (named for n) sends one request per prompt with that
n: its sequences fork from the prompt and share its blocks. Run `independent` sends each prompt n times
as requests with n=1. Both go to one scheduler + worker, with prefix caching off so that forking is the
only sharing (--parallel-prefix-caching turns it on).

Every run checks that each sequence generated exactly its length (ignore_eos) and reports throughput, TTFT,
prompt tokens served from the prefix cache (and so the prompt tokens computed), and the peaks of KV blocks
used and saved by sharing, read from the scheduler's metrics every --sample-interval seconds. The table
goes to stdout; `--json-out` also writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.client import AsyncEngineClient  # noqa: E402
from pagedserve.common.messages import SamplingParams  # noqa: E402
from scripts._bench import (  # noqa: E402
    MetricsSampler,
    add_engine_flags,
    engine_session,
    engine_settings,
    format_table,
    read_metrics,
    resolve_model,
    run_record,
    write_json,
)
from scripts.bench_serving import arrival_offsets, parse_rates, stats_ms  # noqa: E402

PARTS = ("prefix", "parallel")


@dataclass(frozen=True)
class Job:
    """One request of a run: every one of its params.n sequences must generate params.max_tokens tokens."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class JobTiming:
    ttft_s: float | None  # submit to the first token of any sequence
    latency_s: float
    output_lens: list[int]  # per sequence
    finish_reasons: list[str | None]
    cached_tokens: int  # prompt tokens served from the prefix cache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(p, sample_interval=0.2)
    p.add_argument("--parts", default="prefix,parallel", help=f"comma-separated: {','.join(PARTS)}")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, the arrivals and the sampling")
    p.add_argument("--prefix-requests", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--min-question-len", type=int, default=16)
    p.add_argument("--max-question-len", type=int, default=64)
    p.add_argument("--prefix-output-len", type=int, default=128)
    p.add_argument("--request-rate", default="inf", help="prefix part: requests/s (Poisson); inf: at once")
    p.add_argument("--parallel-prompts", type=int, default=64)
    p.add_argument("--parallel-prompt-len", type=int, default=512)
    p.add_argument("--parallel-output-len", type=int, default=256)
    p.add_argument("--parallel-n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0, help="parallel part's sampling temperature")
    p.add_argument("--parallel-prefix-caching", action="store_true", help="parallel part: caching on")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not args.parts or any(s not in PARTS for s in args.parts):
        p.error(f"--parts takes {', '.join(PARTS)}")
    try:
        [args.request_rate] = parse_rates(args.request_rate)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.min_question_len <= args.max_question_len:
        p.error("need 1 <= --min-question-len <= --max-question-len")
    if args.parallel_n < 2 or args.temperature <= 0:
        p.error("parallel sampling needs --parallel-n >= 2 and --temperature > 0")
    return args


def prefix_jobs(args: argparse.Namespace, vocab_size: int) -> list[Job]:
    """One shared system prompt, then a distinct question per request; greedy, exactly the output length."""
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab_size) for _ in range(args.prefix_len)]
    jobs = []
    for _ in range(args.prefix_requests):
        question = [
            rng.randrange(vocab_size)
            for _ in range(rng.randint(args.min_question_len, args.max_question_len))
        ]
        params = SamplingParams(max_tokens=args.prefix_output_len, temperature=0.0, ignore_eos=True)
        jobs.append(Job(system + question, params))
    return jobs


def parallel_jobs(args: argparse.Namespace, vocab_size: int) -> dict[str, list[Job]]:
    """The same prompts as one request with n sequences each, and as n requests with one sequence each."""
    rng = random.Random(args.seed + 1)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(args.parallel_prompt_len)]
        for _ in range(args.parallel_prompts)
    ]
    n = args.parallel_n

    def params(num_seqs: int, seed: int) -> SamplingParams:
        return SamplingParams(
            n=num_seqs,
            max_tokens=args.parallel_output_len,
            temperature=args.temperature,
            seed=seed,
            ignore_eos=True,
        )

    together = [Job(p, params(n, args.seed + i)) for i, p in enumerate(prompts)]
    apart = [Job(p, params(1, args.seed + i * n + k)) for i, p in enumerate(prompts) for k in range(n)]
    return {f"parallel-n{n}": together, "independent": apart}


async def stream_job(client: AsyncEngineClient, job: Job, delay_s: float) -> JobTiming:
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    handle = await client.submit_one(job.prompt_token_ids, job.params)
    ttft_s = None
    lens = [0] * job.params.n
    reasons: list[str | None] = [None] * job.params.n
    cached = 0
    async for delta in handle:
        if delta.token_ids and ttft_s is None:
            ttft_s = time.perf_counter() - start
        lens[delta.index] += len(delta.token_ids)
        reasons[delta.index] = delta.finish_reason or reasons[delta.index]
        cached = max(cached, delta.num_cached_tokens)
    return JobTiming(ttft_s, time.perf_counter() - start, lens, reasons, cached)


async def measure(
    client: AsyncEngineClient, name: str, jobs: list[Job], offsets: list[float], sample_interval: float
) -> dict[str, Any]:
    """Runs `jobs` (job i submitted at offsets[i] s) on a ready engine; checks the lengths and measures."""
    before = await read_metrics(client)
    sampler = MetricsSampler(client, sample_interval)
    sampling = asyncio.create_task(sampler.run())
    start = time.perf_counter()
    timings = await asyncio.gather(*(stream_job(client, j, t) for j, t in zip(jobs, offsets, strict=True)))
    wall_s = time.perf_counter() - start
    sampling.cancel()
    after = await read_metrics(client)
    wrong = [
        (i, t.output_lens, t.finish_reasons)
        for i, (j, t) in enumerate(zip(jobs, timings, strict=True))
        if t.output_lens != [j.params.max_tokens] * j.params.n
    ]
    if wrong:
        raise RuntimeError(
            f"{name}: {len(wrong)} of {len(jobs)} requests have wrong lengths, e.g. {wrong[:3]}"
        )

    def delta(metric: str) -> int:
        key = f"pagedserve_{metric}_total"
        return int(after.get(key, 0) - before.get(key, 0))

    prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
    output_tokens = sum(sum(t.output_lens) for t in timings)
    cached_tokens = sum(t.cached_tokens for t in timings)
    return {
        "name": name,
        "num_requests": len(jobs),
        "num_sequences": sum(j.params.n for j in jobs),
        "completed": len(timings),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(jobs) / wall_s, 3),
        "output_tokens_per_s": round(output_tokens / wall_s, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall_s, 1),
        "ttft_ms": stats_ms([t.ttft_s for t in timings if t.ttft_s is not None]),
        "latency_ms": stats_ms([t.latency_s for t in timings]),
        "cached_tokens": cached_tokens,  # as the requests' usage reports it
        "computed_prompt_tokens": prompt_tokens - cached_tokens,
        "prefix_cache_queries": delta("prefix_cache_queries"),  # the scheduler's counters, in tokens
        "prefix_cache_hits": delta("prefix_cache_hits"),
        "preemptions": delta("preemptions"),
        "peak_kv_blocks_used": sampler.peak("pagedserve_kv_blocks_used"),
        "peak_kv_blocks_saved": sampler.peak("pagedserve_kv_blocks_saved"),
        "peak_running": sampler.peak("pagedserve_requests_running"),
        "num_samples": len(sampler.samples),
    }


async def warm_up(client: AsyncEngineClient, vocab_size: int) -> None:
    """A first prefill, decode and fork (n=2), so that no measured run pays for the first of each."""
    rng = random.Random("warm-up")  # prompts unlike the measured ones: nothing for the prefix cache
    for n in (1, 2):
        prompt = [rng.randrange(vocab_size) for _ in range(40)]
        params = SamplingParams(n=n, max_tokens=4, temperature=1.0, seed=n, ignore_eos=True)
        await client.generate([prompt], params)


async def run_on_engine(
    args: argparse.Namespace,
    model_dir: Path,
    log_dir: Path,
    prefix_caching: bool,
    runs: list[tuple[str, list[Job], list[float]]],
) -> tuple[list[dict[str, Any]], int]:
    """Starts a scheduler + worker, warms it up and measures each (name, jobs, offsets) in turn on it."""
    settings = engine_settings(args, enable_prefix_caching=prefix_caching)
    async with engine_session(model_dir, log_dir, args.ready_timeout, **settings) as (_, client, info):
        await warm_up(client, args.vocab_size)
        rows = []
        for name, jobs, offsets in runs:
            row = await measure(client, name, jobs, offsets, args.sample_interval)
            rows.append(row | {"prefix_caching": prefix_caching})
    return rows, info.num_kv_blocks


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["run", "requests", "seqs", "wall s", "req/s", "out tok/s", "TTFT p50", "TTFT p99"]
    columns += ["cached tok", "computed prompt tok", "peak KV blocks", "peak saved", "preemptions"]
    cells = [
        [
            row["name"],
            str(row["num_requests"]),
            str(row["num_sequences"]),
            f"{row['wall_s']:.2f}",
            f"{row['requests_per_s']:.2f}",
            f"{row['output_tokens_per_s']:.1f}",
            *("-" if row["ttft_ms"][q] is None else f"{row['ttft_ms'][q]:.1f}" for q in ("p50", "p99")),
            str(row["cached_tokens"]),
            str(row["computed_prompt_tokens"]),
            str(row["peak_kv_blocks_used"]),
            str(row["peak_kv_blocks_saved"]),
            str(row["preemptions"]),
        ]
        for row in rows
    ]
    print(format_table(columns, cells))
    print("(TTFT in ms)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir = resolve_model(args.model).resolve()
    vocab_size = args.vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    log_root = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    rows: list[dict[str, Any]] = []
    kv_blocks = 0
    if "prefix" in args.parts:
        jobs = prefix_jobs(args, vocab_size)
        offsets = arrival_offsets(len(jobs), args.request_rate, random.Random(args.seed))
        for name, caching in (("prefix-on", True), ("prefix-off", False)):
            runs = [(name, jobs, offsets)]
            new_rows, kv_blocks = asyncio.run(run_on_engine(args, model_dir, log_root / name, caching, runs))
            rows += new_rows
    if "parallel" in args.parts:
        runs = [(name, jobs, [0.0] * len(jobs)) for name, jobs in parallel_jobs(args, vocab_size).items()]
        caching = args.parallel_prefix_caching
        new_rows, kv_blocks = asyncio.run(
            run_on_engine(args, model_dir, log_root / "parallel", caching, runs)
        )
        rows += new_rows
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    print(f"KV blocks {kv_blocks}, model {model_dir.name}, prefix part's request rate {rate}")
    print_table(rows)
    settings = {
        k: v for k, v in vars(args).items() if k not in ("model", "log_dir", "json_out", "vocab_size")
    }
    settings["request_rate"] = rate
    report = {
        "record": run_record(__file__, argv),
        "benchmark": "sharing",
        "model": str(model_dir),
        "settings": settings,
        "kv_blocks_total": kv_blocks,
        "runs": rows,
    }
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
