"""Multi-turn conversations whose working set outgrows the GPU's KV pool, with and without the host tier.

    python scripts/bench_kv_tiers.py --model /tmp/8b --device cuda --conversations 200 --turns 8 \
        --system-len 1024 --user-len 128 --output-len 128 --concurrency 32 --kv-offload-gb 64 \
        --json-out k.json
    python scripts/bench_kv_tiers.py --device cpu --conversations 8 --turns 3 --system-len 48 --user-len 8 \
        --output-len 4 --num-kv-blocks 16 --concurrency 4 --configs off,host --kv-offload-gb 0.01

Each configuration (`--configs`: `off` is --kv-offload-gb 0, `host` the host tier of --kv-offload-gb GiB,
`disk` adds --kv-disk-dir) starts its own api + scheduler + worker trio and runs the same workload: each
conversation starts with its own system prompt (`--system-len` random token ids), and each turn sends the
whole conversation so far (system prompt, every earlier user message and the model's own answer to it,
as token ids) plus a new user message (`--user-len`), asking for `--output-len` tokens (`ignore_eos`).
Turns go round by round: every conversation's turn t before any conversation's turn t + 1, at most
`--concurrency` requests in flight, so between two turns of one conversation all the others pass through
the pool. Per configuration: TTFT mean/p50/p90/p99 of the returning turns (t >= 1) and of all, output
tokens/s over the run, the share of prompt tokens served from the cache, and the tiers' counters from
/metrics. The table goes to stdout; `--json-out` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

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
from scripts.bench_serving import raise_open_files_limit, stats_ms, wait_healthy  # noqa: E402

TIER_COUNTERS = (
    "pagedserve_kv_host_tier_hits_total",
    "pagedserve_kv_host_tier_stores_total",
    "pagedserve_kv_disk_tier_hits_total",
    "pagedserve_kv_disk_tier_stores_total",
    "pagedserve_kv_disk_tier_read_failures_total",
    "pagedserve_prefix_cache_hits_total",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(p)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024, help="tokens of each conversation's system prompt")
    p.add_argument("--user-len", type=int, default=128, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=128, help="tokens of each answer")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--configs", default="off,host", help="comma-separated: off, host, disk")
    p.add_argument("--kv-offload-gb", type=float, default=16.0, help="the host tier of `host` and `disk`")
    p.add_argument(
        "--kv-disk-dir", default="", help="the disk tier's directory (`disk`; default: a temp dir)"
    )
    p.add_argument("--kv-disk-gb", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or set(args.configs) - {"off", "host", "disk"}:
        p.error("--configs takes off, host and disk")
    if min(args.conversations, args.turns, args.system_len, args.user_len, args.output_len) < 1:
        p.error("every count and length must be at least 1")
    if args.concurrency < 1:
        p.error("need --concurrency >= 1")
    return args


def tier_settings(config: str, args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    """The worker's tier settings of one configuration."""
    if config == "off":
        return {"kv_offload_gb": 0}
    settings: dict[str, object] = {"kv_offload_gb": args.kv_offload_gb}
    if config == "disk":
        settings |= {
            "kv_disk_dir": args.kv_disk_dir or str(log_dir / "kv-disk"),
            "kv_disk_gb": args.kv_disk_gb,
        }
    return settings


async def stream_turn(
    session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int
) -> dict[str, Any]:
    """One streamed turn: its TTFT, its answer's token ids, its cached prompt tokens (or its error)."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    out: dict[str, Any] = {"ttft_s": None, "tokens": [], "cached_tokens": 0, "error": None}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data:") :])
                if "error" in chunk:
                    out["error"] = str(chunk["error"].get("message"))
                    break
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    out["cached_tokens"] = details.get("cached_tokens", 0)
                for choice in chunk.get("choices", []):
                    named = (choice.get("logprobs") or {}).get("tokens", ())
                    out["tokens"] += [int(t.removeprefix("token_id:")) for t in named]
                    if out["ttft_s"] is None and named:
                        out["ttft_s"] = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if out["error"] is None and len(out["tokens"]) != output_len:
        out["error"] = f"wanted {output_len} tokens, got {len(out['tokens'])}"
    return out


async def run_conversations(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, vocab_size: int
) -> tuple[list[dict[str, Any]], float]:
    """Every turn of every conversation, round by round; returns the turns (with their turn index and
    prompt length) and the wall time."""
    rng = random.Random(args.seed)
    history = [[rng.randrange(vocab_size) for _ in range(args.system_len)] for _ in range(args.conversations)]
    gate = asyncio.Semaphore(args.concurrency)
    turns: list[dict[str, Any]] = []

    async def turn(c: int, t: int, prompt: list[int]) -> None:
        async with gate:
            result = await stream_turn(session, url, prompt, args.output_len)
        history[c] = prompt + result["tokens"]
        turns.append(result | {"turn": t, "conversation": c, "prompt_len": len(prompt)})

    start = time.perf_counter()
    for t in range(args.turns):
        users = [[rng.randrange(vocab_size) for _ in range(args.user_len)] for _ in range(args.conversations)]
        await asyncio.gather(*(turn(c, t, history[c] + users[c]) for c in range(args.conversations)))
    return turns, time.perf_counter() - start


def summarize(config: str, turns: list[dict[str, Any]], duration_s: float, counters: dict[str, float]):
    ok = [t for t in turns if t["error"] is None]
    returning = [t for t in ok if t["turn"] > 0]
    prompt_tokens = sum(t["prompt_len"] for t in returning)
    answers = sorted((t["turn"], t["conversation"], t["tokens"]) for t in turns)
    return {
        "config": config,
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "error_examples": [t["error"] for t in turns if t["error"] is not None][:5],
        "duration_s": round(duration_s, 3),
        "output_tokens_per_s": round(sum(len(t["tokens"]) for t in ok) / duration_s, 1),
        "ttft_ms_returning": stats_ms([t["ttft_s"] for t in returning if t["ttft_s"] is not None]),
        "ttft_ms_all": stats_ms([t["ttft_s"] for t in ok if t["ttft_s"] is not None]),
        "cached_share_returning": round(
            sum(t["cached_tokens"] for t in returning) / max(1, prompt_tokens), 4
        ),
        "counters": counters,
        # the greedy answers, in order: configurations that agree computed the same tokens (on a GPU in
        # bf16, batch composition alone may change a late token)
        "answers_digest": hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16],
    }


async def run_config(
    config: str, args: argparse.Namespace, model_dir: Path, log_dir: Path, vocab_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    port = free_port()
    settings = engine_settings(args, host="127.0.0.1", port=port) | tier_settings(config, args, log_dir)
    base_url = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=None, connect=60.0)
    processes = ("scheduler", "worker", "api")
    async with (
        engine_session(model_dir, log_dir / config, args.ready_timeout, processes, **settings) as (
            engine,
            client,
            info,
        ),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session,
    ):
        await wait_healthy(session, base_url, engine, args.ready_timeout)
        before = await read_metrics(client)
        turns, duration_s = await run_conversations(session, base_url + "/v1/completions", args, vocab_size)
        after = await read_metrics(client)
    counters = {k.removeprefix("pagedserve_"): after.get(k, 0) - before.get(k, 0) for k in TIER_COUNTERS}
    engine_info = {"kv_blocks_total": info.num_kv_blocks, "block_size": info.block_size}
    return summarize(config, turns, duration_s, counters), engine_info


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["config", "turns", "errors", "dur s", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99"]
    columns += ["all p50", "cached", "host hits", "disk hits", "answers"]
    cells = []
    for row in rows:
        ttft, c = row["ttft_ms_returning"], row["counters"]
        cells.append(
            [
                row["config"],
                str(row["turns"]),
                str(row["errors"]),
                f"{row['duration_s']:.2f}",
                f"{row['output_tokens_per_s']:.1f}",
                *(f"{ttft[q]:.1f}" if ttft.get(q) is not None else "-" for q in ("p50", "p90", "p99")),
                f"{row['ttft_ms_all']['p50']:.1f}" if row["ttft_ms_all"].get("p50") is not None else "-",
                f"{row['cached_share_returning']:.0%}",
                str(int(c["kv_host_tier_hits_total"])),
                str(int(c["kv_disk_tier_hits_total"])),
                "same" if row["answers_digest"] == rows[0]["answers_digest"] else "differ",
            ]
        )
    print(format_table(columns, cells))
    print("(TTFT in ms, of the returning turns unless 'all'; cached: their prompt tokens served from cache;")
    print(" answers: the greedy answers against the first configuration's)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    raise_open_files_limit()
    model_dir = resolve_model(args.model).resolve()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-kv-tiers-"))
    rows, engine_info = [], {}
    for config in args.configs:
        row, engine_info = asyncio.run(run_config(config, args, model_dir, log_dir, vocab_size))
        rows.append(row)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system {args.system_len}, user "
        f"{args.user_len}, output {args.output_len}, concurrency {args.concurrency}, KV blocks "
        f"{engine_info['kv_blocks_total']} x {engine_info['block_size']}, model {model_dir.name}"
    )
    print_table(rows)
    keys = ("conversations", "turns", "system_len", "user_len", "output_len", "concurrency", "seed")
    keys += (
        "kv_offload_gb",
        "kv_disk_gb",
        "num_kv_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "device",
    )
    report = {
        "record": run_record(__file__, argv),
        "benchmark": "kv_tiers",
        "model": str(model_dir),
        "workload": {k: getattr(args, k) for k in keys},
        "engine": engine_info,
        "runs": rows,
    }
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
