"""Offline throughput: a batch of random requests submitted at once to a scheduler + worker started here.

    python scripts/bench_throughput.py    # 1000 requests: prompts 32-1024 tokens, outputs 16-512
    python scripts/bench_throughput.py --device cpu --num-requests 16 --max-prompt-len 64 \
        --max-output-len 32 --num-kv-blocks 64 --runs paged,reserved --json-out bench.json

Every request has random token ids, a prompt length drawn uniformly from [min, max] prompt length and an
output length drawn uniformly from [min, max] output length (fixed seed, ignore_eos, so it generates exactly
that many). They all go through the ZeroMQ client at once. Each run in `--runs` starts a fresh scheduler and
worker with that `--kv-policy` and the same KV budget (`--num-kv-blocks`), so the runs differ only in policy
(`reserved` claims prompt + max_tokens per request at admission, `reserved-max` claims `--max-model-len`, as
a server that reserves the longest possible sequence for every request);
run `paged-sync` is `paged` with the scheduler's async scheduling off (each plan waits for the last step's
tokens), the baseline that async scheduling is measured against; run `paged-unfused` is `paged` with the
worker's `--no-fused-ops` (PyTorch ops instead of the Triton RMSNorm, RoPE and SiLU-and-mul kernels that it
uses on CUDA by default); run `paged-eager-mixed` is `paged` with `--no-piecewise-graphs` (prefill and
mixed steps run eagerly instead of replaying graphs of everything but the attention).
`--kv-trace DIR` records each run's KV snapshots (DIR/RUN.jsonl) for scripts/kv_replay.py.

Each run first serves `--num-warmup` requests, unmeasured (counters are read before and after the
measurement). While a run goes, a background task reads the scheduler's metrics every `--sample-interval`
seconds: KV waste (1 - slots used / slots allocated, averaged over samples with blocks allocated), the peak
of running requests; preemptions are read at the end. `--peers hf-static,hf-continuous` also runs
transformers (static batching with left padding; its paged continuous batching, which on the CPU needs
psutil) on the first `--peer-requests` requests.
The table goes to stdout; `--json-out` also writes everything as JSON (with the date, GPU, commit and
command line).

Comparisons are bracketed: `--compare BASELINE CANDIDATE` runs the one run (`--runs` / `--kv-policy`) with
the baseline's settings before and after every candidate run, all in this call (A B A; `--repeats 2`:
A B A B A), and prints each candidate beside the baselines around it, its ratio to their mean, and the
baselines' own spread: a ratio within that spread of 1 is noise, not a difference. A side is
`KEY=VALUE[,KEY=VALUE]` over `COMPARE_KEYS`, e.g. `kv_cache_dtype=fp8`, `run=paged-sync`, or
`tree=/tmp/base` for another checkout (`git worktree add /tmp/base COMMIT`) to compare two commits. The FP8
KV rows of docs/benchmarks.md (Llama-3.2-1B shape at /tmp/m1b; same tokens, then same bytes), on a GPU:

    python3 scripts/bench_throughput.py --model /tmp/m1b --device cuda --num-requests 1000 \
        --num-kv-blocks 8192 --max-model-len 2048 --runs paged --repeats 2 \
        --compare kv_cache_dtype=auto kv_cache_dtype=fp8 --json-out fp8-same-tokens.json
    python3 scripts/bench_throughput.py --model /tmp/m1b --device cuda --num-requests 1000 \
        --max-model-len 2048 --runs paged --repeats 2 \
        --compare kv_cache_dtype=auto,num_kv_blocks=8192 kv_cache_dtype=fp8,num_kv_blocks=16384

The logits processors' cost (issue 22: penalties + top-p + min_p on every request within 5% of plain):

    python3 scripts/bench_throughput.py --model /tmp/m1b --device cuda --num-requests 1000 \
        --max-model-len 2048 --runs paged --repeats 2 --compare sampling=plain sampling=penalties

FP8 weights against bf16 (Llama-3-8B shape at /tmp/m8b, quantized at load; docs/models.md "Quantized
checkpoints"), same KV pool on both sides:

    python3 scripts/bench_throughput.py --model /tmp/m8b --device cuda --num-requests 1000 \
        --num-kv-blocks 8192 --max-model-len 2048 --runs paged \
        --compare quantization= quantization=fp8 --json-out fp8-weights-8b.json

Shapes too large to write as checkpoints (Qwen3-30B-A3B: 61 GB) run on random weights that the worker draws
itself (`--load-format dummy`, docs/models.md "Random weights"), from a directory of config.json and
tokenizer only:

    python3 scripts/make_model.py --preset qwen3-30b-a3b --no-weights --out /tmp/q30
    python3 scripts/bench_throughput.py --model /tmp/q30 --load-format dummy --device cuda \
        --num-requests 1000 --max-model-len 2048 --runs paged --json-out qwen3-30b-a3b.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.client import AsyncEngineClient, RequestResult  # noqa: E402
from pagedserve.common.messages import SamplingParams  # noqa: E402
from pagedserve.common.sampling_params import StructuredOutput  # noqa: E402
from pagedserve.worker.step_trace import read_trace  # noqa: E402
from pagedserve.worker.step_trace import summarize as summarize_trace  # noqa: E402
from scripts._bench import (  # noqa: E402
    BenchRequest,
    Bracketed,
    MetricsSampler,
    add_engine_flags,
    add_workload_flags,
    bracket_order,
    cell,
    check_workload_flags,
    engine_session,
    engine_settings,
    format_table,
    git_commit,
    make_workload,
    read_metrics,
    resolve_model,
    run_record,
    write_json,
)
from scripts._servers import ROOT  # noqa: E402

POLICIES = ("paged", "reserved", "reserved-max")
# run name -> (kv policy, async scheduling, fused elementwise kernels (None: the worker's default), piecewise
# CUDA graphs for prefill and mixed steps)
RUNS: dict[str, tuple[str, bool, bool | None, bool]] = {
    **{policy: (policy, True, None, True) for policy in POLICIES},
    "paged-sync": ("paged", False, None, True),
    "paged-unfused": ("paged", True, False, True),
    "paged-eager-mixed": ("paged", True, None, False),
}
# What one side of `--compare` may set, and how its value is read.
COMPARE_KEYS: dict[str, Callable[[str], object]] = {
    "run": str,  # a name of RUNS
    "kv_cache_dtype": str,
    "quantization": str,  # "" (the checkpoint's weights as they are) or fp8 (FP8 linear weights)
    "load_format": str,  # auto (the checkpoint's weights) or dummy (random weights of its shapes)
    "num_kv_blocks": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "json_schema": str,  # a JSON schema file every request's output must follow ("" none)
    "grammar_threads": int,  # the worker's --grammar-threads (0: its default)
    "tree": Path,  # another checkout (e.g. `git worktree add /tmp/base COMMIT`) whose processes run
    "sampling": str,  # a name of SAMPLING
    "kv_offload_gb": float,  # the worker's host tier under the prefix cache (-1: its default; 0: none)
    # the worker's --speculative-config: its JSON (without commas: `{"num_speculative_tokens":4}` is n-gram),
    # or @FILE holding it ("" off)
    "speculative_config": lambda v: Path(v[1:]).read_text().strip() if v.startswith("@") else v,
}
# What every request of the workload samples with (`--sampling`), besides its length, ignore_eos and seed:
# the default (temperature 1, the whole vocabulary), top-p alone, or the logits processors with top-p.
SAMPLING: dict[str, dict[str, float]] = {
    "plain": {},
    "top_p": {"top_p": 0.9},
    "penalties": {
        "top_p": 0.9,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
}
PEERS = ("hf-static", "hf-continuous")
# The settings the JSON's "workload" records.
WORKLOAD_KEYS = """num_requests min_prompt_len max_prompt_len min_output_len max_output_len seed num_kv_blocks
max_num_seqs max_num_batched_tokens device sampling""".split()
_NEEDS_PSUTIL = "hf-continuous on the CPU needs psutil: transformers checks the free memory through it"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(p)
    p.add_argument("--num-requests", type=int, default=1000)
    add_workload_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the sampling")
    p.add_argument(
        "--num-warmup",
        type=int,
        default=32,
        help="requests run before the measurement, in each run (Triton compiles its kernels for the shapes "
        "it meets first; the compile would otherwise land in the first run's time)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="every run's max_model_len (what reserved-max claims per request); 0: the model's own limit",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="worker ranks, one GPU each")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="every engine run's KV pools: auto (the model's dtype) or fp8 (float8 e4m3, half the bytes)",
    )
    p.add_argument(
        "--json-schema",
        default="",
        help="a JSON schema file: every request's output follows it (structured output; ignore_eos keeps "
        "the lengths, the tokens past the document's end being EOS). Compare with plain: "
        "--compare json_schema= json_schema=FILE",
    )
    p.add_argument(
        "--grammar-threads",
        type=int,
        default=0,
        help="the worker's --grammar-threads: xgrammar's threads filling the masks (0: the worker's default, "
        "half the cores, at most 8); e.g. --json-schema FILE --compare grammar_threads=1 grammar_threads=0",
    )
    p.add_argument(
        "--quantization",
        default="",
        choices=("", "fp8"),
        help="every engine run's weights: fp8 quantizes the linear weights to FP8 at load (the worker's "
        "--quantization); a quantized checkpoint runs quantized either way",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="every engine run's weights: auto (the checkpoint's) or dummy (random, drawn on the device by "
        "the worker's --load-format dummy: a model directory of config.json and tokenizer is enough, e.g. "
        "scripts/make_model.py --no-weights)",
    )
    p.add_argument(
        "--kv-policy", default="paged", choices=POLICIES, help="the one run when --runs is not given"
    )
    p.add_argument(
        "--kv-offload-gb",
        type=float,
        default=-1.0,
        help="the worker's host-memory KV tier (docs/kv_tiers.md): -1 its default, 0 none; e.g. "
        "--compare kv_offload_gb=0 kv_offload_gb=-1",
    )
    p.add_argument(
        "--sampling",
        default="plain",
        choices=tuple(SAMPLING),
        help="what every request samples with: plain (temperature 1), top_p (0.9), or penalties (presence, "
        "frequency and repetition penalties, min_p 0.05 and top_p 0.9)",
    )
    p.add_argument("--runs", default=None, help=f"comma-separated runs, one after another: {','.join(RUNS)}")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("BASELINE", "CANDIDATE"),
        default=None,
        help="bracketed comparison of two settings of the one run, each KEY=VALUE[,KEY=VALUE] with KEY in "
        f"{','.join(COMPARE_KEYS)}: the baseline runs before and after every candidate run",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="--compare: candidate runs (1: A B A, 2: A B A B A, ...)"
    )
    p.add_argument("--peers", default="", help=f"comma-separated transformers baselines: {','.join(PEERS)}")
    p.add_argument("--peer-requests", type=int, default=128, help="the peers run the first N requests")
    p.add_argument(
        "--peer-batch-size",
        default="32",
        help="hf-static's batch size; a comma-separated list runs it once per size (32,128: the best of two)",
    )
    p.add_argument(
        "--step-trace",
        action="store_true",
        help="the worker traces every step (LOG_DIR/RUN/steps.jsonl, worker/step_trace.py); each run reports "
        "where the decode steps' GPU idle time came from",
    )
    p.add_argument(
        "--kv-trace",
        default="",
        metavar="DIR",
        help="each run's scheduler records its KV snapshots to DIR/RUN.jsonl (--kv-trace on the scheduler), "
        "for /dashboard's replay and scripts/kv_replay.py (e.g. --runs paged,reserved-max)",
    )
    args = p.parse_args(argv)
    if args.kv_trace:
        Path(args.kv_trace).mkdir(parents=True, exist_ok=True)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()] if args.runs else [args.kv_policy]
    args.peers = [r.strip() for r in args.peers.split(",") if r.strip()]
    try:
        args.peer_batch_sizes = [int(n) for n in args.peer_batch_size.split(",") if n.strip()]
    except ValueError:
        p.error(f"--peer-batch-size: integers, comma-separated, not {args.peer_batch_size!r}")
    if not args.peer_batch_sizes or min(args.peer_batch_sizes) < 1:
        p.error("--peer-batch-size: at least one size, each >= 1")
    for bad in [r for r in args.runs if r not in RUNS] + [r for r in args.peers if r not in PEERS]:
        p.error(f"unknown run or peer {bad!r}")
    if args.compare:
        try:
            args.compare = [(text, parse_side(text)) for text in args.compare]
        except ValueError as e:
            p.error(f"--compare: {e}")
        if len(args.runs) != 1 or args.repeats < 1:
            p.error("--compare brackets one run (--runs or --kv-policy names it), --repeats >= 1")
        for bad in [side["run"] for _, side in args.compare if side.get("run", args.runs[0]) not in RUNS]:
            p.error(f"--compare: unknown run {bad!r}")
    if args.peers and args.load_format == "dummy":
        p.error("--peers load the checkpoint's weights with transformers: not with --load-format dummy")
    if "hf-continuous" in args.peers and args.device == "cpu" and importlib.util.find_spec("psutil") is None:
        p.error(_NEEDS_PSUTIL)
    check_workload_flags(p, args)
    return args


def parse_side(text: str) -> dict[str, object]:
    """One side of `--compare`: `KEY=VALUE[,KEY=VALUE]` (an empty text: the flags as they are)."""
    side: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in COMPARE_KEYS:
            raise ValueError(f"{item!r} is not KEY=VALUE with KEY in {', '.join(COMPARE_KEYS)}")
        side[key] = COMPARE_KEYS[key](value)
    return side


async def _warm_up(client: AsyncEngineClient, args: argparse.Namespace, vocab_size: int) -> None:
    """`--num-warmup` requests of the workload's prompt lengths (another seed), a few tokens each."""
    params = SamplingParams(max_tokens=min(8, args.max_output_len), ignore_eos=True)
    warm = make_workload(args, vocab_size, args.num_warmup, args.seed + 1)
    handles = [await client.submit_one(r.prompt_token_ids, params) for r in warm]
    await asyncio.gather(*(h.result() for h in handles))


def check_outputs(name: str, workload: list[BenchRequest], results: list[RequestResult]) -> None:
    """Raises RuntimeError unless every request came back with exactly its output length."""
    wrong = [
        (i, req.output_len, [len(o.token_ids) for o in res.outputs], [o.finish_reason for o in res.outputs])
        for i, (req, res) in enumerate(zip(workload, results, strict=True))
        if [len(o.token_ids) for o in res.outputs] != [req.output_len]
    ]
    if wrong:
        shown = "\n".join(
            f"  request {i}: wanted {want}, got {got} ({why})" for i, want, got, why in wrong[:10]
        )
        raise RuntimeError(
            f"{name}: {len(wrong)} of {len(workload)} requests have the wrong length:\n{shown}"
        )


async def run_engine(
    args: argparse.Namespace,
    model_dir: Path,
    run: str,
    workload: list[BenchRequest],
    log_dir: Path,
    root: Path = ROOT,
) -> dict[str, Any]:
    """One run: start scheduler + worker (of the checkout at `root`) as `run` says, submit the whole
    workload at once, measure."""
    policy, async_scheduling, fused_ops, piecewise_graphs = RUNS[run]
    settings = engine_settings(
        args,
        kv_policy=policy,
        async_scheduling=async_scheduling,
        fused_ops=fused_ops,
        piecewise_graphs=piecewise_graphs,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        load_format=args.load_format,
        kv_offload_gb=args.kv_offload_gb,
        grammar_threads=args.grammar_threads or None,  # (a --compare tree= side may predate the flag)
        tensor_parallel_size=args.tensor_parallel_size,
        step_trace=str(log_dir / "steps.jsonl") if args.step_trace else None,
        kv_trace=str(Path(args.kv_trace) / f"{run}.jsonl") if args.kv_trace else None,
    )
    session = engine_session(model_dir, log_dir, args.ready_timeout, root=root, **settings)
    structured = None
    if args.json_schema:
        structured = StructuredOutput("json_schema", Path(args.json_schema).read_text())
    async with session as (_, client, info):
        await _warm_up(client, args, info.vocab_size)
        before = await read_metrics(client)
        sampler = MetricsSampler(client, args.sample_interval)
        sampling = asyncio.create_task(sampler.run())
        start = time.perf_counter()
        handles = []
        for i, req in enumerate(workload):
            params = SamplingParams(
                max_tokens=req.output_len,
                ignore_eos=True,
                seed=args.seed + i,
                structured=structured,
                **SAMPLING[args.sampling],
            )
            handles.append(await client.submit_one(req.prompt_token_ids, params))
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        wall_s = time.perf_counter() - start
        sampling.cancel()
        after = await read_metrics(client)
        final = {name: value - before.get(name, 0.0) for name, value in after.items()}  # counters
    check_outputs(run, workload, results)
    trace = None
    if args.step_trace:  # the warm-up's steps come first: skip them
        warm_up_steps = int(before.get("pagedserve_steps_total", 0))
        trace = summarize_trace(read_trace(log_dir / "steps.jsonl")[warm_up_steps:])
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(r.num_output_tokens for r in results)
    waste = sampler.mean_kv_waste()
    return {
        "name": run,
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_policy": policy,
        "async_scheduling": async_scheduling,
        "fused_ops": "default" if fused_ops is None else fused_ops,
        "piecewise_graphs": piecewise_graphs,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "load_format": args.load_format,
        "grammar_threads": args.grammar_threads,
        "json_schema": args.json_schema or None,
        "num_kv_blocks": info.num_kv_blocks,
        "max_model_len": info.max_model_len,
        "block_size": info.block_size,
        "num_requests": len(workload),
        "completed": len(results),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.output_len for r in workload),
        "output_lens": [r.num_output_tokens for r in results],
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(results) / wall_s, 3),
        "output_tokens_per_s": round(output_tokens / wall_s, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall_s, 1),
        "mean_kv_waste": None if waste is None else round(waste, 4),
        "peak_running": sampler.peak("pagedserve_requests_running"),
        "preemptions": int(final.get("pagedserve_preemptions_total", 0)),
        "swap_outs": int(final.get("pagedserve_swap_outs_total", 0)),
        # GPU time (CUDA events per step) over the run's wall time, and over decode-only steps' wall time.
        "gpu_busy": _ratio(final.get("pagedserve_gpu_seconds_total"), wall_s),
        "decode_gpu_busy": _ratio(
            final.get("pagedserve_decode_gpu_seconds_total"),
            final.get("pagedserve_decode_step_seconds_total"),
        ),
        # Decode-only steps run as CUDA graphs on a GPU; the others (prefill, mixed) run eagerly.
        "steps": int(final.get("pagedserve_steps_total", 0)),
        "decode_steps": int(final.get("pagedserve_decode_steps_total", 0)),
        "gpu_s": _rounded(final.get("pagedserve_gpu_seconds_total")),
        "decode_gpu_s": _rounded(final.get("pagedserve_decode_gpu_seconds_total")),
        "num_samples": len(sampler.samples),
        "step_trace": trace,
    }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 3) if part and whole else None


def run_peer(
    args: argparse.Namespace,
    model_dir: Path,
    peer: str,
    workload: list[BenchRequest],
    batch_size: int | None = None,
) -> dict[str, Any]:
    """A transformers baseline on `workload`: greedy, exactly each request's output length (hf-static in
    batches of `batch_size`)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if peer == "hf-continuous" and device == "cpu" and importlib.util.find_spec("psutil") is None:
        raise SystemExit(_NEEDS_PSUTIL)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    pad_id = 0
    output_tokens = 0
    generated_tokens = 0  # static batching also computes the padding past each request's own length
    wrong_lengths = 0
    start = time.perf_counter()
    # Not for hf-continuous: its generation thread updates, outside inference mode, tensors it made on this
    # one, which torch refuses ("Inplace update to inference tensor outside InferenceMode"), and every
    # request comes back failed with no tokens.
    with torch.inference_mode(peer == "hf-static"):
        if peer == "hf-static":
            assert batch_size is not None, "hf-static needs a batch size"
            for b in range(0, len(workload), batch_size):
                batch = workload[b : b + batch_size]
                width = max(len(r.prompt_token_ids) for r in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
                    ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                    mask[row, width - len(r.prompt_token_ids) :] = 1
                new_tokens = max(r.output_len for r in batch)
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,  # ignore_eos
                    do_sample=False,
                    pad_token_id=pad_id,
                )
                if out.shape[1] - width != new_tokens:
                    raise RuntimeError(
                        f"{peer}: generated {out.shape[1] - width} tokens, wanted {new_tokens}"
                    )
                output_tokens += sum(r.output_len for r in batch)
                generated_tokens += new_tokens * len(batch)
        else:
            lengths = _run_hf_continuous(args, model, workload)
            # Only the tokens each request asked for count; a peer that returns other lengths says so.
            output_tokens = sum(min(n, r.output_len) for n, r in zip(lengths, workload, strict=True))
            generated_tokens = sum(lengths)
            wrong_lengths = sum(n != r.output_len for n, r in zip(lengths, workload, strict=True))
            if wrong_lengths:
                print(
                    f"{peer}: {wrong_lengths} of {len(workload)} requests came back with another length than "
                    f"asked (e.g. {lengths[0]} for {workload[0].output_len}); counting min(returned, asked)",
                    file=sys.stderr,
                )
    wall_s = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    return {
        "name": peer,
        "batch_size": batch_size,
        "num_requests": len(workload),
        "completed": len(workload),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": generated_tokens,
        "wrong_lengths": wrong_lengths,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(workload) / wall_s, 3),
        "output_tokens_per_s": round(output_tokens / wall_s, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall_s, 1),
    }


def _run_hf_continuous(args: argparse.Namespace, model: Any, workload: list[BenchRequest]) -> list[int]:
    """transformers' continuous batching (paged cache) on the workload; returns each request's number of
    generated tokens.

    Its KV pool is sized like ours (--num-kv-blocks of 16 tokens, else a pool holding the whole workload):
    left to size itself from memory, it fails on CPU.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    num_blocks = args.num_kv_blocks or sum(
        -(-(len(r.prompt_token_ids) + r.output_len) // 16) for r in workload
    )
    cb_config = ContinuousBatchingConfig(
        block_size=16, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=args.max_output_len)
    manager_cm = model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=5
    )
    lengths: dict[str, int] = {}
    with manager_cm as manager:
        for i, r in enumerate(workload):
            manager.add_request(
                r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len, eos_token_id=-1
            )
        while len(lengths) < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.error is not None:
                raise RuntimeError(f"hf-continuous: request {result.request_id} failed: {result.error}")
            if result is not None and result.is_finished():
                lengths[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("hf-continuous: the generation thread stopped")
    return [lengths[str(i)] for i in range(len(workload))]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["run", "requests", "wall s", "req/s", "out tok/s", "total tok/s", "KV waste", "peak running"]
    columns += ["preemptions", "GPU busy", "decode GPU busy", "steps (decode)", "GPU s decode / other"]
    cells = []
    for row in rows:
        waste = row.get("mean_kv_waste")
        steps, gpu_s, decode_gpu_s = row.get("steps"), row.get("gpu_s"), row.get("decode_gpu_s")
        name = row["name"] if row.get("batch_size") is None else f"{row['name']} (batch {row['batch_size']})"
        name = name if row.get("role") is None else f"{row['role']} {row['side']}"
        cells.append(
            [
                name,
                str(row["completed"]),
                f"{row['wall_s']:.2f}",
                f"{row['requests_per_s']:.2f}",
                f"{row['output_tokens_per_s']:.1f}",
                f"{row['total_tokens_per_s']:.1f}",
                "-" if waste is None else f"{waste:.1%}",
                cell(row.get("peak_running")),
                cell(row.get("preemptions")),
                _percent(row.get("gpu_busy")),
                _percent(row.get("decode_gpu_busy")),
                "-" if steps is None else f"{steps} ({row['decode_steps']})",
                "-" if not gpu_s else f"{decode_gpu_s or 0:.2f} / {gpu_s - (decode_gpu_s or 0):.2f}",
            ]
        )
    print(format_table(columns, cells))


def run_bracketed(
    args: argparse.Namespace, model_dir: Path, workload: list[BenchRequest], log_root: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`--compare`: the baseline before and after every candidate run, all in this call (so that a drift of
    the machine between calls cannot pass for a difference); each run's row, and the comparison."""
    sides = dict(zip(("baseline", "candidate"), args.compare, strict=True))
    rows = []
    for i, role in enumerate(bracket_order(args.repeats)):
        text, side = sides[role]
        flags = {k: v for k, v in side.items() if k not in ("run", "tree")}
        side_args = argparse.Namespace(**(vars(args) | flags))
        run = str(side.get("run", args.runs[0]))
        root = Path(side.get("tree", ROOT))  # type: ignore[arg-type]
        row = asyncio.run(run_engine(side_args, model_dir, run, workload, log_root / f"{i}-{role}", root))
        rows.append(row | {"role": role, "side": text, "commit": git_commit(root)})
    comparison: dict[str, Any] = {"baseline": sides["baseline"][0], "candidate": sides["candidate"][0]}
    for metric in ("output_tokens_per_s", "total_tokens_per_s"):
        comparison[metric] = Bracketed(tuple((r["role"], r[metric]) for r in rows)).summary()
    return rows, comparison


def print_comparison(comparison: dict[str, Any]) -> None:
    """Each candidate run between the baseline runs before and after it, and its ratio to their mean."""
    columns = ["tok/s", "baseline before", "candidate", "baseline after", "candidate / baselines"]
    cells = []
    for metric, label in (("output_tokens_per_s", "out"), ("total_tokens_per_s", "total")):
        values, ratios = comparison[metric]["values"], comparison[metric]["bracket_ratios"]
        for k, ratio in enumerate(ratios):
            before, candidate, after = values[2 * k : 2 * k + 3]
            cells.append(
                [f"{label} #{k + 1}", f"{before:.1f}", f"{candidate:.1f}", f"{after:.1f}", f"{ratio:.3f}"]
            )
    sides = [comparison[role] or "(the flags as given)" for role in ("baseline", "candidate")]
    print(f"baseline: {sides[0]}; candidate: {sides[1]}")
    print(format_table(columns, cells))
    out = comparison["output_tokens_per_s"]
    print(
        f"out tok/s: candidate / baseline {out['ratio']:.3f} ({out['ratio'] - 1:+.1%}); the baselines' own "
        f"spread {out['baseline_spread']:.1%} (a ratio within it of 1 is noise)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir = resolve_model(args.model).resolve()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab_size)
    log_root = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    comparison = None
    if args.compare:
        runs, comparison = run_bracketed(args, model_dir, workload, log_root)
    else:
        runs = [asyncio.run(run_engine(args, model_dir, p, workload, log_root / p)) for p in args.runs]
    peer_workload = workload[: args.peer_requests]
    peers = [
        run_peer(args, model_dir, peer, peer_workload, size)
        for peer in args.peers
        for size in (args.peer_batch_sizes if peer == "hf-static" else [None])
    ]
    print(
        f"{len(workload)} requests, prompts {args.min_prompt_len}-{args.max_prompt_len}, "
        f"outputs {args.min_output_len}-{args.max_output_len}, KV blocks {runs[0]['num_kv_blocks']} "
        f"x {runs[0]['block_size']}, model {model_dir.name}"
    )
    print_table(runs + peers)
    if comparison is not None:
        print_comparison(comparison)
    traced = [(row["name"], row["step_trace"]) for row in runs if row.get("step_trace")]
    if traced:
        print("decode steps, from the worker's step trace (ms):")
        columns = ["run", *traced[0][1]]
        print(format_table(columns, [[name, *(cell(v) for v in t.values())] for name, t in traced]))
    report = {
        "record": run_record(__file__, argv),
        "model": str(model_dir),
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "requests": [{"prompt_len": len(r.prompt_token_ids), "output_len": r.output_len} for r in workload],
        "runs": runs,
        "peers": peers,
    }
    if comparison is not None:
        report["comparison"] = comparison
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
