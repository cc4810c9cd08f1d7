"""A profile of one decode step at tensor parallelism N: scripts/bench_step.py's profile on N ranks.

    python scripts/bench_tp_step.py --model /tmp/m8b --tensor-parallel-size 2 [--batch 256,512]
        [--variants nccl,symm_mem] [--kernels 8] [--steps 32] [--modes graphs] [--json-out FILE]

The ranks are spawned here (one process per GPU, NCCL between them, or gloo on the CPU); rank 0 runs the
scheduler core and forwards each plan to the others, as the worker does. For each batch size and each
variant, a runner is built on every rank and `--steps` decode steps are timed on rank 0 (wall time, GPU
time from CUDA events), then with `--kernels N` N more run under torch.profiler on rank 0: GPU time per
kernel group, the all-reduces per step (count, GPU time, message size) and the GPU's idle time per step
(the step's wall time less its kernels' time).

Variants (`--tp-all-reduce`'s choices), on the same commit, to measure what each change buys:
  nccl      every all-reduce through NCCL (as before issue 25)
  one-shot  the partial sums copied into a symmetric buffer, torch's one-shot all-reduce from there, for
            messages up to 16 MiB (worker/tp_all_reduce.py; `symm_mem` is an old name for it)
  no-copy   o_proj/down_proj write their partial sums into the symmetric buffer themselves, then the
            one-shot all-reduce (worker/tp_fused.py)
  fused     as no-copy, the all-reduce, residual add and RMSNorm in one kernel (kernels/all_reduce_norm.py)
The fused kernel counts in the profile's all-reduce group (its name says all_reduce), norm included.

Before the steps, the all-reduce of each message size (256 KiB .. 64 MiB: decode batches and prefill
chunks) is timed through NCCL, the one-shot and the two-shot kernels (`SymmMemAllReduce.tune`, what the
worker measures at start-up to route each size): the table says where two-shot beats NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from pagedserve.worker.loader import load_model_config  # noqa: E402
from pagedserve.worker.parallel import init_parallel  # noqa: E402
from pagedserve.worker.tp_all_reduce import make_symm_mem_all_reduce  # noqa: E402
from pagedserve.worker.tp_fused import make_row_parallel  # noqa: E402
from scripts._bench import add_worker_flags, write_json  # noqa: E402
from scripts.bench_step import WORKER_FLAGS, profile  # noqa: E402

VARIANTS = ("nccl", "one-shot", "no-copy", "fused")
TIMEOUT_S = 530.0


def all_reduce_summary(r: dict, hidden_size: int, element_size: int) -> dict:
    """The all-reduces and idle time of one step, from the kernel profile of rank 0."""
    k = r["kernels"]
    if not k:
        return {}
    reduces = [row for row in k["kernels"] if row["group"] == "all-reduce"]
    return {
        "all_reduce_calls": round(sum(row["calls"] for row in reduces), 2),
        "all_reduce_us": round(sum(row["us"] for row in reduces), 1),
        # every all-reduce of a decode step (embedding, o_proj, down_proj) sums one [batch, hidden] row set
        "all_reduce_message_bytes": r["batch"] * hidden_size * element_size,
        "kernel_us": k["total_us"],
        "gpu_idle_ms": round(max(0.0, r["step_wall_ms"] - k["total_us"] / 1e3), 3),
        "all_reduce_kernels": [row["name"][:80] for row in reduces],
    }


def _rank_main(rank: int, args: argparse.Namespace, init_method: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.tensor_parallel_size))
    from scripts._bench import worker_config

    base = worker_config(
        args,
        WORKER_FLAGS,
        tensor_parallel_size=args.tensor_parallel_size,
        rank=rank,
        dist_init_method=init_method,
        tp_all_reduce="nccl",  # the one-shot path is made below, once, and switched per variant
    )
    model_config = load_model_config(args.model)
    cfg, parallel = init_parallel(base, model_config)
    fast, why = make_symm_mem_all_reduce(
        parallel.group, parallel.control_group, torch.device(cfg.device), parallel.world_size, "auto"
    )
    if parallel.is_driver:
        print_tuning(fast.tuning if fast is not None else [])
    paths: dict[str, tuple[Any, Any, str]] = {"nccl": (None, None, ""), "one-shot": (fast, None, why)}
    for variant in ("no-copy", "fused"):
        if variant in args.variants:
            rp, rp_why = make_row_parallel(
                parallel.group, parallel.control_group, torch.device(cfg.device), parallel.world_size, variant
            )
            paths[variant] = (fast, rp, why or rp_why)
    element_size = 4 if cfg.resolved_dtype == "float32" else 2
    results: list[dict[str, Any]] = []
    for batch in args.batch:
        for variant in args.variants:
            one_shot, row_parallel, why_not = paths[variant]
            if variant != "nccl" and (one_shot is None or (variant != "one-shot" and row_parallel is None)):
                results.append({"variant": variant, "batch": batch, "skipped": why_not})
                continue
            parallel.fast_all_reduce, parallel.row_parallel = one_shot, row_parallel
            run_args = argparse.Namespace(**{**vars(args), "batch": batch})
            for mode in args.modes:
                r = profile(
                    run_args, mode, parallel, device=cfg.device, tensor_parallel_size=parallel.world_size,
                    rank=rank, dist_init_method=init_method,
                )  # fmt: skip
                if r is None:
                    continue  # a follower
                r = {"variant": variant, "tensor_parallel_size": parallel.world_size, **r}
                r.update(all_reduce_summary(r, model_config.hidden_size, element_size))
                print_row(r)
                results.append(r)
    if parallel.is_driver:
        sizes = fast.tuning if fast is not None else [{"error": why}]
        Path(out).write_text(json.dumps({"steps": results, "all_reduce_sizes": sizes}))
    parallel.close()


def print_tuning(rows: list[dict]) -> None:
    """The all-reduce time per message size of each kernel (the slowest rank's), and the one taken."""
    print("| message MiB | NCCL us | one-shot us | two-shot us | taken |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"tuning failed: {r['error']}")
            continue
        cells = [r["bytes"] / (1 << 20), r["nccl_us"], r["one-shot_us"], r["two-shot_us"], r["best"]]
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    print("| variant | mode | batch | step ms | GPU ms | tok/s | all-reduces | all-reduce us | idle ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)


def print_row(r: dict) -> None:
    cells = [r["variant"], r["mode"], r["batch"], r["step_wall_ms"], r["gpu_ms"], r["decode_tok_s"]]
    cells += [r.get("all_reduce_calls", "-"), r.get("all_reduce_us", "-"), r.get("gpu_idle_ms", "-")]
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    if r["kernels"]:
        groups = ", ".join(f"{g} {us:.0f}" for g, us in r["kernels"]["groups"].items())
        print(f"    GPU us per step by group: {groups}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(p, WORKER_FLAGS, device="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--batch", default="256", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--modes", default="graphs", help="graphs,eager (graphs needs CUDA)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    p.add_argument("--kernels", type=int, default=0, help="profile N more steps per kernel (CUDA)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    args.prefill_len = 0
    args.batch = [int(b) for b in args.batch.split(",") if b]
    args.variants = [{"symm_mem": "one-shot"}.get(v, v) for v in args.variants.split(",") if v]
    if bad := set(args.variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    args.modes = [m for m in args.modes.split(",") if m]
    if args.device == "cpu":
        args.modes = [m for m in args.modes if m != "graphs"] or ["eager"]
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tensor_parallel_size:
        p.error(f"--tensor-parallel-size {args.tensor_parallel_size}: {torch.cuda.device_count()} GPUs")
    from scripts._servers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        context = mp.start_processes(
            _rank_main,
            args=(args, f"tcp://127.0.0.1:{free_port()}", out),
            nprocs=args.tensor_parallel_size,
            join=False,
            start_method="spawn",
        )
        try:
            for _ in range(int(TIMEOUT_S)):
                if context.join(timeout=1):
                    break
            else:
                raise SystemExit(f"the ranks did not finish within {TIMEOUT_S} s")
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
        results = json.loads(Path(out).read_text())
    write_json(args.json_out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
