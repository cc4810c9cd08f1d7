"""A profile of one decode step, the scheduler core and the worker's ModelRunner in one process.

    python scripts/bench_step.py --model /tmp/m1b --device cuda [--batch 256] [--context 512] [--steps 64]
        [--modes graphs,eager] [--prefill-len N] [--no-fused-ops] [--no-piecewise-graphs] [--kernels N]
        [--quantizations none,fp8] [--json-out FILE]

`--batch` requests with `--context`-token random prompts are prefilled, then `--steps` decode steps are timed
(median). Each step is what the engine loop does, without the sockets: `schedule()`, the plan's msgpack
round trip, `execute()` on the runner, the output's round trip and `update()`. Reported per step: the wall
time, the GPU time of the forward and sampling (CUDA events around them), the scheduler's share (schedule +
update + codec) and the rest of the worker's host time; the GPU-busy fraction of the step is GPU time over
wall time. `graphs` and `eager` (--enforce-eager) are two runners on the same weights, measured in turn.

With `--prefill-len N` the timed steps are mixed ones instead: before each, a new request with an N-token
prompt arrives, so the step runs the decodes and that whole prefill (as the engine runs such steps: piecewise
graphs in mode graphs unless `--no-piecewise-graphs`, eagerly in mode eager).

With `--kernels N` (CUDA), N more steps of each mode run under torch.profiler and the GPU time a step spends
in each kernel is reported, largest first, grouped by what the kernel does (attention, matrix products, the
fused elementwise kernels, the sampler, copies): where a step's GPU time goes. Kernels replayed from CUDA
graphs are traced one by one like eager ones.

With `--quantizations none,fp8` every mode runs once per weight format on the same checkpoint (`fp8`: the
worker's `--quantization fp8`, FP8 weights quantized at load; `none`: the checkpoint's own dtype), and a last
table gives FP8's step time and GPU time over the unquantized one's, mode by mode. With `--load-format dummy`
no checkpoint weights are read (a config.json is enough: the 8B shape needs no download):

    python scripts/make_model.py --preset llama-3-8b --no-weights --out /tmp/m8b
    python scripts/bench_step.py --model /tmp/m8b --load-format dummy --quantizations none,fp8 \
        --modes graphs --batch 256 --context 512 --steps 20 --kernels 5
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import torch  # noqa: E402

from pagedserve.common.log import get_logger  # noqa: E402
from pagedserve.common.messages import SamplingParams, Shutdown, SubmitRequest, decode, encode  # noqa: E402
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402
from scripts._bench import add_worker_flags, in_process_scheduler, worker_config, write_json  # noqa: E402

# The worker's own flags (--fused-ops, --piecewise-graphs, ...); the rest of its config follows the workload.
WORKER_FLAGS = ("model", "device", "fused_ops", "piecewise_graphs", "load_format")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What a kernel does, from its name: the first group whose words the name contains (lower case).
_KERNEL_GROUPS = (
    ("all-reduce", ("allreduce", "all_reduce")),  # NCCL's ncclDevKernel_AllReduce_*, symm_mem's one-shot
    ("all-gather", ("allgather", "all_gather")),
    ("attention", ("attention", "combine_splits")),
    ("kv write", ("write_kv",)),
    ("fp8 quant", ("quantize_rows",)),  # per-token activation quantization (kernels/fp8_quant.py)
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "f8f8bf16", "scaled_mm")),
    ("rmsnorm/rope/silu", ("rms_norm", "rope", "silu")),
    ("copy", ("memcpy", "memset", "copy")),
    ("sampler and other", ("",)),
)


def kernel_group(name: str) -> str:
    lower = name.lower()
    return next(group for group, words in _KERNEL_GROUPS if any(w in lower for w in words))


def kernel_times(step, steps: int) -> dict:
    """GPU time per step by kernel (microseconds), from `steps` calls of `step` under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = per_name.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    kernels = [
        dict(name=name, group=kernel_group(name), us=round(us / steps, 1), calls=round(calls / steps, 2))
        for name, (us, calls) in per_name.items()
    ]
    kernels.sort(key=lambda k: -k["us"])
    groups: dict[str, float] = {}
    for k in kernels:
        groups[k["group"]] = groups.get(k["group"], 0.0) + k["us"]
    return {
        "steps": steps,
        "total_us": round(sum(k["us"] for k in kernels), 1),
        "groups": {g: round(us, 1) for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
        "kernels": kernels,
    }


def profile(args: argparse.Namespace, mode: str, parallel: Any = None, **overrides: Any) -> dict | None:
    """One mode's step profile. With a tensor-parallel `parallel` (scripts/bench_tp_step.py), rank 0 runs
    the scheduler and forwards each plan to the other ranks, which follow it and return None."""
    bs = 16
    # Sequences that finish their prefill early decode while the others prefill: room for those tokens too.
    max_tokens = args.steps + args.kernels + 8 + -(-args.batch * args.context // args.max_num_batched_tokens)
    max_len = max(args.context, args.prefill_len) + max_tokens + 16
    max_num_seqs = args.batch + (args.steps + args.kernels + 3 if args.prefill_len else 0)
    num_blocks = max_num_seqs * -(-max_len // bs) + 16
    cfg = worker_config(
        args,
        WORKER_FLAGS,
        num_kv_blocks=num_blocks,
        swap_space=0,
        max_model_len=max_len if args.device == "cpu" else 0,
        max_num_seqs=max_num_seqs,
        enforce_eager=mode == "eager",
        **overrides,
    )
    started = time.monotonic()
    runner = ModelRunner(cfg, attention_backend=cfg.resolved_attention_backend, parallel=parallel)
    startup_s = time.monotonic() - started
    if parallel is not None and not parallel.is_driver:
        from pagedserve.worker.server import _follow  # runs the plans rank 0 forwards until its Shutdown

        _follow(runner, parallel, get_logger(process="bench", rank=parallel.rank))
        runner.close()
        return None
    core = in_process_scheduler(runner, max_num_seqs, args.max_num_batched_tokens)
    assert (runner.num_kv_blocks, runner.block_size) == (num_blocks, bs)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    ids = itertools.count()

    def arrive(prompt_len: int) -> None:
        prompt = [rng.randrange(runner.vocab_size) for _ in range(prompt_len)]
        core.add_request(b"bench", SubmitRequest(f"r{next(ids)}", prompt, params))

    for _ in range(args.batch):
        arrive(args.context)

    def step() -> tuple[float, float, list[int]]:
        t0 = time.perf_counter()
        plan = core.schedule()
        frames = encode(plan)
        if parallel is not None:
            parallel.forward_to_followers(frames)
        plan_back = decode(frames)
        t1 = time.perf_counter()
        out = runner.execute(plan_back)
        t2 = time.perf_counter()
        core.update(decode(encode(out)))
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), t2 - t1, plan.num_scheduled_tokens

    # Prefill (and the first decodes, which compile kernels) until every sequence decodes.
    while True:
        _, _, scheduled = step()
        if len(scheduled) == args.batch and max(scheduled) == 1:
            break

    def next_step() -> None:  # one more step as timed below, its prompt arriving first in mixed mode
        if args.prefill_len:
            arrive(args.prefill_len)
        step()

    for _ in range(3):
        next_step()
    _sync(runner.device)
    walls, scheds, works, gpus = [], [], [], []
    for _ in range(args.steps):
        if args.prefill_len:
            arrive(args.prefill_len)
        t0 = time.perf_counter()
        sched_s, work_s, scheduled = step()
        walls.append(time.perf_counter() - t0)
        scheds.append(sched_s)
        works.append(work_s)
        gpus.append(runner.last_step_gpu_s)
        if args.prefill_len:
            assert scheduled[-1] == args.prefill_len, f"the step prefilled {scheduled[-1]} tokens"
        else:
            assert len(scheduled) == args.batch, f"a step ran {len(scheduled)} sequences, not {args.batch}"
    wall = statistics.median(walls)
    gpu = statistics.median(gpus)
    sched = statistics.median(scheds)
    traced = args.kernels and runner.device.type == "cuda"
    kernels = kernel_times(next_step, args.kernels) if traced else None
    if parallel is not None:
        parallel.forward_to_followers(encode(Shutdown("profile done")))
    result = {
        "mode": mode,
        "quantization": cfg.quantization or "none",
        "fused_ops": cfg.resolved_fused_ops,
        "piecewise_graphs": runner.mixed_graphs is not None,
        "batch": args.batch,
        "context": args.context,
        "prefill_len": args.prefill_len,
        "startup_s": round(startup_s, 2),
        "graph_capture_s": round(runner.graphs.capture_time_s, 2) if runner.graphs else 0.0,
        "step_wall_ms": round(wall * 1e3, 3),
        "gpu_ms": round(gpu * 1e3, 3),
        "scheduler_ms": round(sched * 1e3, 3),
        "worker_host_ms": round(max(0.0, statistics.median(works) - gpu) * 1e3, 3),
        "gpu_busy": round(gpu / wall, 3) if gpu else None,
        "decode_tok_s": round(args.batch / wall),
        "kernels": kernels,
    }
    runner.close()  # drops the graphs: before the next mode's runner, and before a group is destroyed
    return result


def print_kernels(r: dict, top: int = 12) -> None:
    k = r["kernels"]
    print(f"\nGPU time per step by kernel, mode {r['mode']}, {k['steps']} steps: {k['total_us']:.0f} us")
    print("| group | us | share |\n|---|---:|---:|")
    for group, us in k["groups"].items():
        print(f"| {group} | {us:.0f} | {us / k['total_us']:.0%} |")
    print("\n| kernel | group | calls | us |\n|---|---|---:|---:|")
    for row in k["kernels"][:top]:
        print(f"| {row['name'][:90]} | {row['group']} | {row['calls']:g} | {row['us']:.0f} |")
    print(flush=True)


def print_ratios(results: list[dict]) -> None:
    """Each weight format's step time, GPU time and kernel groups over the first format's, mode by mode."""
    base_q = results[0]["quantization"]
    base = {r["mode"]: r for r in results if r["quantization"] == base_q}
    print(f"\n| mode | weights | step time vs {base_q} | GPU time vs {base_q} | tok/s vs {base_q} |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        b = base[r["mode"]]
        if r is b:
            continue
        gpu = f"{r['gpu_ms'] / b['gpu_ms']:.3f}" if b["gpu_ms"] else "-"
        print(
            f"| {r['mode']} | {r['quantization']} | {r['step_wall_ms'] / b['step_wall_ms']:.3f} | {gpu} | "
            f"{r['decode_tok_s'] / b['decode_tok_s']:.3f} |"
        )
        if r["kernels"] and b["kernels"]:
            groups = dict.fromkeys([*b["kernels"]["groups"], *r["kernels"]["groups"]])
            print(f"\n| group (mode {r['mode']}) | {base_q} us | {r['quantization']} us |\n|---|---:|---:|")
            for g in groups:
                mine, theirs = r["kernels"]["groups"].get(g, 0.0), b["kernels"]["groups"].get(g, 0.0)
                print(f"| {g} | {theirs:.0f} | {mine:.0f} |")
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(p, WORKER_FLAGS, device="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--modes", default="graphs,eager", help="graphs,eager (graphs needs CUDA)")
    p.add_argument(
        "--prefill-len", type=int, default=0, help="time mixed steps: the decodes and one prefill this long"
    )
    p.add_argument(
        "--kernels", type=int, default=0, help="profile N more steps and report GPU time per kernel (CUDA)"
    )
    p.add_argument(
        "--quantizations",
        default="none",
        help="weight formats, comma-separated: none (the checkpoint's dtype), fp8 (quantized at load)",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    quantizations = [q for q in args.quantizations.split(",") if q]
    if not quantizations or set(quantizations) - {"none", "fp8"}:
        p.error(f"--quantizations takes none and fp8, comma-separated, not {args.quantizations!r}")
    modes = [m for m in args.modes.split(",") if m]
    if args.device == "cpu":
        modes = [m for m in modes if m != "graphs"] or ["eager"]
    results = []
    columns = ["mode", "weights", "batch", "context", "prefill", "step ms", "GPU ms", "scheduler ms"]
    columns += ["worker host ms"]
    print("| " + " | ".join([*columns, "GPU busy", "tok/s"]) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for quantization, mode in itertools.product(quantizations, modes):
        r = profile(args, mode, quantization="" if quantization == "none" else quantization)
        assert r is not None
        results.append(r)
        busy = f"{r['gpu_busy']:.0%}" if r["gpu_busy"] is not None else "-"
        print(
            f"| {mode} | {r['quantization']} | {r['batch']} | {r['context']} | {r['prefill_len']} | "
            f"{r['step_wall_ms']:.2f} | {r['gpu_ms']:.2f} | "
            f"{r['scheduler_ms']:.2f} | {r['worker_host_ms']:.2f} | {busy} | {r['decode_tok_s']:,} |",
            flush=True,
        )
        if r["kernels"]:
            print_kernels(r)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if len(quantizations) > 1:
        print_ratios(results)
    write_json(args.json_out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
