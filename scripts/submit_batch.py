"""Submits a batch of prompts straight to the scheduler through the ZeroMQ client; prints throughput.

    python scripts/submit_batch.py --num-prompts 256 --prompt-len 128 --max-tokens 64
    python scripts/submit_batch.py --text "Once upon a time" --num-prompts 4 --max-tokens 32 --show 4

Prompts are random token ids (`--prompt-len` each) unless `--text` is given. The table goes to stdout;
`--json-out` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.client import AsyncEngineClient, RequestHandle, RequestResult, SequenceResult  # noqa: E402
from pagedserve.common.config import DEFAULT_SCHEDULER_ADDRESS, ENV_PREFIX  # noqa: E402
from pagedserve.common.messages import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_address = os.environ.get(ENV_PREFIX + "SCHEDULER_ADDRESS", DEFAULT_SCHEDULER_ADDRESS)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=default_address, help="the scheduler's client address")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per random prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--text", default=None, help="send this text as every prompt instead of random ids")
    p.add_argument("--n", type=int, default=1, help="sequences per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the sampling")
    p.add_argument("--tokenizer", default=None, help="checkpoint directory; default: the served one")
    p.add_argument("--show", type=int, default=3, help="print the first SHOW outputs")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the scheduler to be ready")
    p.add_argument("--json-out", default=None, help="also write the numbers to this JSON file")
    return p.parse_args(argv)


async def wait_ready(client: AsyncEngineClient, timeout_s: float) -> int:
    """Waits until a worker is ready; returns the vocabulary size."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await client.info(timeout=2.0)
            if info.ready:
                return info.vocab_size
        except TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the scheduler at {client.address} was not ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def consume(handle: RequestHandle, start: float) -> tuple[RequestResult, float]:
    """The request's result and the seconds from submission to its first delta."""
    outputs = [SequenceResult(i) for i in range(handle.params.n)]
    first_delta_s = 0.0
    num_prompt_tokens = len(handle.prompt_token_ids)
    async for delta in handle:
        first_delta_s = first_delta_s or time.perf_counter() - start
        seq = outputs[delta.index]
        seq.token_ids.extend(delta.token_ids)
        if delta.text is not None:
            seq.text = (seq.text or "") + delta.text
        seq.finish_reason = delta.finish_reason or seq.finish_reason
        num_prompt_tokens = delta.num_prompt_tokens
    result = RequestResult(handle.request_id, handle.prompt_token_ids, outputs, num_prompt_tokens)
    return result, first_delta_s


async def run(args: argparse.Namespace) -> dict[str, float]:
    async with AsyncEngineClient(args.address, args.tokenizer) as client:
        vocab_size = await wait_ready(client, args.wait)
        rng = random.Random(args.seed)
        prompts: list[str | list[int]]
        if args.text is not None:
            prompts = [args.text] * args.num_prompts
        else:
            prompts = [
                [rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)
            ]
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        start = time.perf_counter()
        handles = await client.submit(prompts, params)
        done = await asyncio.gather(*(consume(h, start) for h in handles))
        elapsed = time.perf_counter() - start

    results = [r for r, _ in done]
    first_delta_s = [t for _, t in done]
    output_tokens = sum(r.num_output_tokens for r in results)
    stats = {
        "num_requests": len(results),
        "prompt_tokens": sum(r.num_prompt_tokens for r in results),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(results) / elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "mean_time_to_first_token_s": round(sum(first_delta_s) / len(first_delta_s), 4),
    }
    for name, value in stats.items():
        print(f"{name:<28} {value}")
    for r in results[: args.show]:
        for seq in r.outputs:
            shown = repr(seq.text) if seq.text is not None else seq.token_ids
            print(f"[{r.request_id}#{seq.index} {seq.finish_reason}] {shown}")
    return stats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stats = asyncio.run(run(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
