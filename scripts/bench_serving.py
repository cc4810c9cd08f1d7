"""Online serving: requests arrive as a Poisson process, at each of several rates, through the HTTP API.

    python scripts/bench_serving.py --model /tmp/m1b --device cuda --num-requests 256 --rates 2,8,32,inf
    python scripts/bench_serving.py --device cpu --num-requests 8 --max-prompt-len 64 --max-output-len 16 \
        --rates 4,inf --json-out serving.json

One api + scheduler + worker trio serves every rate. The workload is bench_throughput's (random token ids,
prompt and output lengths uniform in their ranges, fixed seed); each request is a streamed /v1/completions
call with the prompt as token ids, `max_tokens` its output length and `ignore_eos`, so it generates exactly
that many tokens (checked against the usage chunk). At rate r, requests leave at exponentially distributed
gaps of mean 1/r seconds; `inf` sends them all at once. Every rate sends the same prompts under its own
`cache_salt`, so a rate never reuses the prefix-cache entries of the one before.

Per request: TTFT (send to first streamed chunk), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (the
gaps between consecutive chunks). The api sends a chunk per step for each token with text; a token whose
text is empty (held back for a partial character, or an id past a random-weight preset's small tokenizer)
sends none. `--logprobs` on (the default when the model's vocabulary outgrows its tokenizer) asks for
`logprobs: 0`, so that every token streams its own chunk, at the cost of a logprob each.

Per rate: the mean, p50, p90 and p99 of those, completed requests and errors, requests/s and output tokens/s
over the rate's duration (first send to last answer), and scheduler metrics sampled meanwhile. The table
goes to stdout; `--json-out` also writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.client import load_tokenizer  # noqa: E402
from scripts._bench import (  # noqa: E402
    BenchRequest,
    MetricsSampler,
    Timing,
    add_engine_flags,
    add_workload_flags,
    check_workload_flags,
    engine_session,
    engine_settings,
    format_table,
    make_workload,
    read_metrics,
    resolve_model,
    run_record,
    write_json,
)
from scripts._servers import Engine, free_port  # noqa: E402

STAT_NAMES = ("mean", "p50", "p90", "p99")


@dataclass
class RequestTiming:
    """What one streamed request measured; `error` is None when it came back whole."""

    prompt_len: int
    output_len: int  # wanted: max_tokens with ignore_eos
    ttft_s: float | None = None
    latency_s: float | None = None
    itls_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks
    streamed_tokens: int = 0  # tokens the chunks' logprobs list (with logprobs on)
    output_tokens: int = 0  # usage.completion_tokens
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def parse_rates(text: str) -> list[float]:
    """`1,4,inf` -> [1.0, 4.0, inf]; raises ValueError for a rate that is not positive."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(p)
    p.add_argument("--num-requests", type=int, default=500, help="requests sent at each rate")
    p.add_argument("--rates", default="1,4,16,inf", help="comma-separated requests/s; inf: all at once")
    add_workload_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload, the arrivals and the sampling")
    p.add_argument("--num-warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument(
        "--logprobs",
        default="auto",
        choices=("auto", "on", "off"),
        help="ask for logprobs, so that tokens without text still stream a chunk; auto: on when the "
        "model's vocabulary is larger than its tokenizer's (random-weight presets)",
    )
    args = p.parse_args(argv)
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as e:
        p.error(str(e))
    if args.num_requests < 1 or args.num_warmup < 0:
        p.error("need --num-requests >= 1 and --num-warmup >= 0")
    check_workload_flags(p, args)
    return args


def arrival_offsets(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics; None when empty."""
    return Timing(tuple(values)).quantile(q / 100) if values else None


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of seconds, in milliseconds."""
    if not values:
        return dict.fromkeys(STAT_NAMES)
    out = {"mean": sum(values) / len(values)} | {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    return {k: round(v * 1000.0, 3) for k, v in out.items() if v is not None}


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timing: RequestTiming
) -> RequestTiming:
    """Posts one streamed completion and fills in `timing` from its server-sent events."""
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                timing.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return timing
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    timing.error = f"in stream: {chunk['error'].get('message')}"
                    break
                now = time.perf_counter()
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    timing.cached_tokens = details.get("cached_tokens", 0)
                for choice in chunk.get("choices", []):
                    timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
                    timing.streamed_tokens += len((choice.get("logprobs") or {}).get("tokens", ()))
                if chunk.get("choices"):
                    if timing.ttft_s is None:
                        timing.ttft_s = now - start
                    else:
                        timing.itls_s.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        timing.error = f"{type(e).__name__}: {e}"
        return timing
    timing.latency_s = time.perf_counter() - start
    if timing.error is None and (timing.output_tokens, timing.finish_reason) != (timing.output_len, "length"):
        timing.error = (
            f"wanted {timing.output_len} tokens, got {timing.output_tokens} ({timing.finish_reason})"
        )
    return timing


def completion_body(req: BenchRequest, seed: int, cache_salt: str, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": cache_salt,
    }
    # A token without text sends no chunk; with logprobs, every token does (its logprob is something to send).
    if logprobs:
        body["logprobs"] = 0
    return body


async def send_all(
    session: aiohttp.ClientSession,
    url: str,
    workload: list[BenchRequest],
    offsets: list[float] | None,
    args: argparse.Namespace,
    cache_salt: str,
) -> tuple[list[RequestTiming], float]:
    """Sends request i at `offsets[i]` seconds from now (None: all now); returns the timings and the wall
    time of it all."""
    start = time.perf_counter()
    tasks = []
    for i, (req, offset) in enumerate(zip(workload, offsets or [0.0] * len(workload), strict=True)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        timing = RequestTiming(len(req.prompt_token_ids), req.output_len)
        body = completion_body(req, args.seed + i, cache_salt, args.use_logprobs)
        tasks.append(asyncio.create_task(stream_completion(session, url, body, timing)))
    timings = list(await asyncio.gather(*tasks))
    return timings, time.perf_counter() - start


def summarize(rate: float, timings: list[RequestTiming], duration_s: float) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    output_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(t.prompt_len for t in ok)
    errors = [t.error for t in timings if t.error is not None]
    return {
        "rate": rate_label(rate),
        "request_rate": None if math.isinf(rate) else rate,  # offered load; None: all at once
        "num_requests": len(timings),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": errors[:5],
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens_per_s": round(output_tokens / duration_s, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / duration_s, 1),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "ttft_ms": stats_ms([t.ttft_s for t in ok if t.ttft_s is not None]),
        "tpot_ms": stats_ms([t.tpot_s for t in ok if t.tpot_s is not None]),
        "itl_ms": stats_ms([gap for t in ok for gap in t.itls_s]),
        "latency_ms": stats_ms([t.latency_s for t in ok if t.latency_s is not None]),
        "per_request": [
            {
                "output_tokens": t.output_tokens,
                "ttft_s": None if t.ttft_s is None else round(t.ttft_s, 5),
                "latency_s": None if t.latency_s is None else round(t.latency_s, 5),
                "num_chunks": len(t.itls_s) + (t.ttft_s is not None),
                "streamed_tokens": t.streamed_tokens,
                "error": t.error,
            }
            for t in timings
        ],
    }


async def wait_healthy(
    session: aiohttp.ClientSession, base_url: str, engine: Engine, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        engine.check_alive()
        try:
            async with session.get(base_url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the api was not healthy within {timeout_s:.0f} s:\n{engine.logs('api')}")
        await asyncio.sleep(0.2)


async def run_rates(
    args: argparse.Namespace, model_dir: Path, workload: list[BenchRequest], log_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Starts the trio once and runs the workload at every rate; returns the per-rate rows and engine info."""
    port = free_port()
    settings = engine_settings(args, host="127.0.0.1", port=port)
    base_url = f"http://127.0.0.1:{port}"
    url = base_url + "/v1/completions"
    rows = []
    # No connection limit: at rate inf every request needs its own connection at once.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=60.0)
    processes = ("scheduler", "worker", "api")
    async with (
        engine_session(model_dir, log_dir, args.ready_timeout, processes, **settings) as (
            engine,
            client,
            info,
        ),
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):
        await wait_healthy(session, base_url, engine, args.ready_timeout)
        warm, _ = await send_all(session, url, workload[: args.num_warmup], None, args, "warm-up")
        if any(t.error is not None for t in warm):
            raise RuntimeError(f"warm-up requests failed: {[t.error for t in warm]}")
        for rate in args.rates:
            before = await read_metrics(client)
            sampler = MetricsSampler(client, args.sample_interval)
            sampling = asyncio.create_task(sampler.run())
            label = rate_label(rate)
            offsets = arrival_offsets(len(workload), rate, random.Random(f"{args.seed}-{label}"))
            timings, duration_s = await send_all(session, url, workload, offsets, args, f"rate-{label}")
            sampling.cancel()
            after = await read_metrics(client)
            row = summarize(rate, timings, duration_s)
            row["peak_running"] = sampler.peak("pagedserve_requests_running")
            row["peak_kv_blocks_used"] = sampler.peak("pagedserve_kv_blocks_used")
            for name in ("preemptions", "prefix_cache_hits"):
                key = f"pagedserve_{name}_total"
                row[name] = int(after.get(key, 0) - before.get(key, 0))
            rows.append(row)
    return rows, {"kv_blocks_total": info.num_kv_blocks, "block_size": info.block_size}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["rate", "done", "errors", "dur s", "req/s", "out tok/s"]
    columns += ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "peak running"]
    cells = [
        [
            row["rate"],
            str(row["completed"]),
            str(row["errors"]),
            f"{row['duration_s']:.2f}",
            f"{row['requests_per_s']:.2f}",
            f"{row['output_tokens_per_s']:.1f}",
            *(_ms(row[m].get(q)) for m in ("ttft_ms", "tpot_ms", "itl_ms") for q in ("p50", "p99")),
            str(row["peak_running"]),
        ]
        for row in rows
    ]
    print(format_table(columns, cells))
    print("(latencies in ms)")


def raise_open_files_limit() -> None:
    """At rate inf every request holds a socket: lift the soft limit on open files to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    raise_open_files_limit()
    model_dir = resolve_model(args.model).resolve()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab_size)
    args.use_logprobs = args.logprobs == "on" or (
        args.logprobs == "auto" and len(load_tokenizer(model_dir)) < vocab_size
    )
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-serving-"))
    rows, engine_info = asyncio.run(run_rates(args, model_dir, workload, log_dir))
    print(
        f"{len(workload)} requests per rate, prompts {args.min_prompt_len}-{args.max_prompt_len}, "
        f"outputs {args.min_output_len}-{args.max_output_len}, KV blocks {engine_info['kv_blocks_total']} "
        f"x {engine_info['block_size']}, model {model_dir.name}, logprobs {args.use_logprobs}"
    )
    print_table(rows)
    keys = ("num_requests", "min_prompt_len", "max_prompt_len", "min_output_len", "max_output_len", "seed")
    keys += (
        "num_warmup",
        "num_kv_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "device",
        "use_logprobs",
    )
    report = {
        "record": run_record(__file__, argv),
        "benchmark": "serving",
        "model": str(model_dir),
        "workload": {k: getattr(args, k) for k in keys},
        "engine": engine_info,
        "requests": [{"prompt_len": len(r.prompt_token_ids), "output_len": r.output_len} for r in workload],
        "runs": rows,
    }
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
