"""Speculative decoding's latency: TPOT at 1, 4 and 16 concurrent streams, with and without each proposer.

    python scripts/bench_speculative.py --model /ckpt/target-1b --device cuda \
        --configs off '{"method": "ngram", "num_speculative_tokens": 4}' \
        '{"method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 4}' \
        --concurrency 1,4,16 --requests-per-stream 8 --output-len 256 --json-out spec.json
    python scripts/bench_speculative.py --device cpu --configs off '{"num_speculative_tokens": 3}' \
        --concurrency 1,2 --requests-per-stream 2 --output-len 16 --max-prompt-len 64

For each config (`off`: no speculation) the api + scheduler + worker trio starts once (the worker with
`--speculative-config` set to it); then, for each concurrency c, c streams each send `--requests-per-stream`
streamed /v1/completions one after another (closed loop: c requests in flight at all times). Prompts are
sentences of the checkpoint's synthetic language when `scripts/train_synthetic.py` trained it (so that a
draft model trained on the same language, and prompt lookup, have something to find), else random token
ids; every request generates exactly `--output-len` tokens (ignore_eos) at `--temperature` (0: greedy).

Per (config, concurrency): TTFT and TPOT p50 / p99 (TPOT = (latency - TTFT) / (tokens - 1)), output
tokens/s, and from the scheduler's metrics the draft tokens verified and accepted, the mean accepted per
drafting sequence and step, and the acceptance-length histogram. The speedup column is TPOT p50 without
speculation over TPOT p50 with it, at the same concurrency, on the same machine.

`--draft-ahead both` runs each speculative config twice, with the worker drafting ahead of the plans (a
draft model: worker/spec/ahead.py) and without (`--no-speculative-draft-ahead`, the row's config says
"no draft ahead"). With `--step-trace DIR`, each run's trace (all its concurrencies) is summarized into the
JSON's `step_traces` (worker/step_trace.py `summarize`: the decode steps' GPU and idle time, the launch's
phases, the steps that took drafts made ahead and the host time drafting ahead took).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.common.speculative import parse_speculative_config  # noqa: E402
from pagedserve.worker.step_trace import read_trace  # noqa: E402
from pagedserve.worker.step_trace import summarize as summarize_trace  # noqa: E402
from scripts._bench import (  # noqa: E402
    add_engine_flags,
    engine_session,
    engine_settings,
    format_table,
    read_metrics,
    resolve_model,
    run_record,
    write_json,
)
from scripts._servers import free_port  # noqa: E402
from scripts.bench_serving import RequestTiming, stats_ms, stream_completion, wait_healthy  # noqa: E402
from scripts.train_synthetic import SyntheticLanguage  # noqa: E402

SPEC_KEYS = ("draft_tokens", "accepted_tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(p)
    p.add_argument(
        "--configs", nargs="+", default=["off", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent streams")
    p.add_argument("--requests-per-stream", type=int, default=8)
    p.add_argument("--min-prompt-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--speculative-draft-budget", type=int, default=None, help="the scheduler's; default its own"
    )
    p.add_argument("--speculative-min-accepted", type=float, default=None, help="the scheduler's")
    p.add_argument(
        "--step-trace",
        default="",
        help="a directory: the worker traces each step of run i to DIR/config-i.jsonl (worker/step_trace)",
    )
    p.add_argument(
        "--draft-ahead",
        choices=("on", "off", "both"),
        default="on",
        help="the worker's --speculative-draft-ahead for the speculative configs; both: a run with each",
    )
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
        for config in args.configs:
            if config != "off":
                parse_speculative_config(config)
    except ValueError as e:
        p.error(str(e))
    if not args.concurrency or min(args.concurrency) < 1 or args.requests_per_stream < 1:
        p.error("need concurrency levels >= 1 and --requests-per-stream >= 1")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len or args.output_len < 2:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len and --output-len >= 2")
    return args


def make_prompts(model_dir: Path, vocab_size: int, num: int, args: argparse.Namespace) -> list[list[int]]:
    language = SyntheticLanguage.load(model_dir)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_prompt_len, args.max_prompt_len) for _ in range(num)]
    if language is None:
        return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    sentences = language.sample(np.random.default_rng(args.seed), num, max(lengths))
    return [sentences[i, :n].tolist() for i, n in enumerate(lengths)]


def body(prompt: list[int], args: argparse.Namespace, seed: int, salt: str) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": args.output_len,
        "ignore_eos": True,
        "temperature": args.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,  # no request reuses another's prefix-cache entries
        "logprobs": 0,  # every token streams a chunk, even one without text
    }


async def run_streams(
    session: aiohttp.ClientSession,
    url: str,
    prompts: list[list[int]],
    c: int,
    args: argparse.Namespace,
    tag: str,
) -> tuple[list[RequestTiming], float]:
    """c closed-loop streams over `prompts` (c * requests_per_stream of them)."""
    start = time.perf_counter()

    async def stream(s: int) -> list[RequestTiming]:
        out = []
        for r in range(args.requests_per_stream):
            i = s * args.requests_per_stream + r
            timing = RequestTiming(len(prompts[i]), args.output_len)
            out.append(await stream_completion(session, url, body(prompts[i], args, i, f"{tag}-{i}"), timing))
        return out

    results = await asyncio.gather(*(stream(s) for s in range(c)))
    return [t for r in results for t in r], time.perf_counter() - start


def summarize(config: str, c: int, timings: list[RequestTiming], duration_s: float, spec: dict) -> dict:
    ok = [t for t in timings if t.error is None]
    row = {
        "config": config,
        "concurrency": c,
        "completed": len(ok),
        "errors": [t.error for t in timings if t.error is not None][:5],
        "duration_s": duration_s,
        "output_tokens_per_s": sum(t.output_tokens for t in ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": stats_ms([t.ttft_s for t in ok if t.ttft_s is not None]),
        "tpot_ms": stats_ms([t.tpot_s for t in ok if t.tpot_s is not None]),
    }
    return row | spec


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {
        k: after.get(f"pagedserve_spec_{k}_total", 0) - before.get(f"pagedserve_spec_{k}_total", 0)
        for k in SPEC_KEYS
    }
    steps = after.get("pagedserve_spec_acceptance_length_count", 0) - before.get(
        "pagedserve_spec_acceptance_length_count", 0
    )
    d["drafting_seq_steps"] = steps
    d["mean_accepted"] = d["accepted_tokens"] / steps if steps else None  # per drafting sequence and step
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    return d


async def run_config(
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[list[int]],
    config: str,
    log_dir: Path,
    index: int = 0,
    ahead: bool = True,
) -> list[dict]:
    """Run `index` of the benchmark: one engine with `config`, every concurrency."""
    port = free_port()
    extra: dict[str, object] = {"host": "127.0.0.1", "port": port}
    extra["speculative_config"] = "" if config == "off" else config
    extra["speculative_draft_ahead"] = ahead
    label = config if ahead or config == "off" else f"{config} (no draft ahead)"
    for name in ("speculative_draft_budget", "speculative_min_accepted"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    if args.step_trace:
        Path(args.step_trace).mkdir(parents=True, exist_ok=True)
        extra["step_trace"] = str(Path(args.step_trace) / f"config-{index}.jsonl")
    settings = engine_settings(args, **extra)
    base_url = f"http://127.0.0.1:{port}"
    url = base_url + "/v1/completions"
    rows = []
    timeout = aiohttp.ClientTimeout(total=None, connect=60.0)
    async with (
        engine_session(
            model_dir, log_dir, args.ready_timeout, ("scheduler", "worker", "api"), **settings
        ) as (engine, client, _),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session,
    ):
        await wait_healthy(session, base_url, engine, args.ready_timeout)
        await run_streams(
            session,
            url,
            prompts[:2],
            2,
            argparse.Namespace(**{**vars(args), "requests_per_stream": 1}),
            "warm",
        )
        for c in args.concurrency:
            before = await read_metrics(client)
            timings, duration = await run_streams(session, url, prompts, c, args, f"{config}-{c}")
            after = await read_metrics(client)
            rows.append(summarize(label, c, timings, duration, spec_delta(before, after)))
    if args.step_trace:  # (the worker has closed the file)
        trace = summarize_trace(read_trace(Path(str(extra["step_trace"]))))
        for row in rows:
            row["step_trace"] = trace
    return rows


def print_table(rows: list[dict]) -> None:
    base = {r["concurrency"]: r["tpot_ms"].get("p50") for r in rows if r["config"] == "off"}
    columns = [
        "config",
        "streams",
        "done",
        "out tok/s",
        "TTFT p50",
        "TPOT p50",
        "TPOT p99",
        "speedup",
        "accepted/step",
        "accept rate",
    ]
    cells = []
    for r in rows:
        p50 = r["tpot_ms"].get("p50")
        b = base.get(r["concurrency"])
        cells.append([
            r["config"] if len(r["config"]) < 40 else r["config"][:37] + "...",
            str(r["concurrency"]),
            str(r["completed"]),
            f"{r['output_tokens_per_s']:.1f}",
            _ms(r["ttft_ms"].get("p50")),
            _ms(p50),
            _ms(r["tpot_ms"].get("p99")),
            "-" if not p50 or not b else f"{b / p50:.2f}x",
            "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}",
            "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
        ])  # fmt: skip
    print(format_table(columns, cells))
    print("(latencies in ms; speedup: TPOT p50 without speculation / with it)")


def _ahead_modes(config: str, draft_ahead: str) -> list[bool]:
    if config == "off":
        return [True]
    return {"on": [True], "off": [False], "both": [True, False]}[draft_ahead]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir = resolve_model(args.model).resolve()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(model_dir, vocab_size, max(args.concurrency) * args.requests_per_stream, args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-spec-"))
    rows = []
    runs = [(config, ahead) for config in args.configs for ahead in _ahead_modes(config, args.draft_ahead)]
    for index, (config, ahead) in enumerate(runs):
        rows += asyncio.run(run_config(args, model_dir, prompts, config, log_dir, index, ahead))
    print_table(rows)
    traces = {r["config"]: r.pop("step_trace") for r in rows if "step_trace" in r}
    for config, trace in traces.items():
        keys = ("gpu_ms_p50", "idle_ms_p50", "propose_ms_p50", "drafted_ahead_steps", "drafted_ahead_ms_p50")
        print(f"step trace, {config}: " + ", ".join(f"{k} {trace.get(k)}" for k in keys))
    report = {
        "record": run_record(__file__, argv),
        "benchmark": "speculative",
        "model": str(model_dir),
        "runs": rows,
        "step_traces": traces,
    }
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
