"""Benchmarks of the Triton paged-attention kernels against this GPU's measured ceilings, in one run.

    python scripts/bench_kernels.py --out bench-results/kernels.json [--sweep]

Ceilings measured first: device-to-device copy bandwidth (bytes read + written) and the bf16 matrix-product
rate (8192^3). Decode: bytes moved (KV read + query + output) per second as a fraction of the copy bandwidth,
for the Triton kernel on a paged cache (split-KV chosen automatically) and for torch's
scaled_dot_product_attention (enable_gqa) on a contiguous cache. Prefill: causal attention TFLOP/s over the
matrix-product rate. Each timing is the median over CUDA-event-timed replays of a CUDA graph that runs the
kernel once on each of several input sets, rotated so that together they exceed the L2 several times.
`--sweep` adds split-count and tile-shape sweeps used to tune the defaults. `--smoke` runs tiny shapes on the
CPU under TRITON_INTERPRET=1 to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedserve.kernels import cache_ops, reference  # noqa: E402
from pagedserve.kernels.attention_config import (  # noqa: E402
    DECODE_CONFIG,
    AttentionConfig,
    SplitCombine,
    choose_num_splits,
    decode_config,
    padded_head_dim,
    prefill_config,
)
from pagedserve.kernels.attention_tiles import load_rows  # noqa: E402
from pagedserve.kernels.reference import is_fp8, kv_pool  # noqa: E402
from pagedserve.kernels.triton_attention import paged_attention  # noqa: E402
from scripts._bench import git_commit, write_json  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
KV_DTYPE = DTYPE  # the paged pools' dtype: bf16, or float8 e4m3 (--kv-dtype fp8; scales 1.0)
ROTATE_BYTES = 256 << 20  # input sets together at least this large (the H100's L2 is 50 MB)
MAX_SETS = 64
GRAPH_CALLS = 32
KV_LAYOUT = "head"  # blocks in memory: "head"-major as the worker keeps them, or "token"-major (--kv-layout)


def time_per_call(
    fns: list[Callable[[], object]], device: torch.device, min_reps: int = 10, graph: bool = True
) -> float:
    """Seconds per call: median over timed replays of one CUDA graph that runs the fns in turn, at least
    GRAPH_CALLS calls, so that the replay's own launch cost (about 9 us on an H200) is spread thin (or over
    timed runs of the plain launches, when graph is False)."""
    for fn in fns:
        fn()  # compile and warm up
    if device.type != "cuda":
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) / len(fns)
    torch.cuda.synchronize()
    if graph:
        fns = fns * math.ceil(GRAPH_CALLS / len(fns))
    run: Callable[[], object]
    try:
        if not graph:
            raise RuntimeError("graphs off")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for fn in fns:
                fn()
        run = cuda_graph.replay
    except RuntimeError as e:  # not capturable: time the launches, gaps included
        if graph:
            print(f"  (no CUDA graph: {str(e).splitlines()[0][:80]})", file=sys.stderr)
        torch.cuda.synchronize()

        def run() -> None:
            for fn in fns:
                fn()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    reps = min_reps
    while len(times) < reps:
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        if len(times) == 1:
            reps = max(min_reps, min(200, int(0.25 / times[0])))
    return statistics.median(times) / len(fns)


def measure_copy_bandwidth(device: torch.device, nbytes: int, graph: bool = False) -> float:
    """Bytes read + written per second by a device-to-device copy (cudaMemcpyAsync through torch). Inside a
    CUDA graph the copy becomes a memcpy node, which ran at about 2/3 of this rate on an H200."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_per_call([lambda: dst.copy_(src)], device, graph=graph)


def measure_matmul_rate(device: torch.device, n: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=DTYPE) for _ in range(2))
    return 2 * n**3 / time_per_call([lambda: a @ b], device)


def _num_sets(set_bytes: int) -> int:
    return max(2, min(MAX_SETS, math.ceil(ROTATE_BYTES / set_bytes)))


def _fits(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes < 0.85 * free


def _paged_inputs(
    num_sets: int, batch: int, ctx: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One random K and V pool holding every set's contexts, laid out as KV_LAYOUT says; each set's block
    tables a random slice."""
    blocks = ctx // BLOCK_SIZE
    total = num_sets * batch * blocks
    shape = (total, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (
        kv_pool(lambda m: torch.randn(m, device=device, dtype=DTYPE).to(KV_DTYPE), *shape, KV_LAYOUT)
        for _ in "kv"
    )
    perm = torch.randperm(total, generator=gen).to(device=device, dtype=torch.int32)
    tables = [t.view(batch, blocks) for t in perm.split(batch * blocks)]
    return k_cache, v_cache, tables


def bench_decode(
    batch: int,
    ctx: int,
    device: torch.device,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    combine: SplitCombine | None = None,
) -> dict:
    """`combine` overrides where the splits are combined (the config's default otherwise)."""
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * KV_DTYPE.itemsize
    qo_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    num_sets = _num_sets(kv_bytes)
    if not _fits(num_sets * kv_bytes * 1.1, device):
        return {"batch": batch, "ctx": ctx, "skipped": "does not fit"}
    gen = torch.Generator().manual_seed(batch * ctx)
    k_cache, v_cache, tables = _paged_inputs(num_sets, batch, ctx, device, gen)
    queries = [torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(num_sets)]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    splits = num_splits or choose_num_splits(device, batch, NUM_KV_HEADS, ctx, HEAD_DIM)
    if combine is not None:
        config = replace(
            config or decode_config(HEAD_DIM, is_fp8(k_cache), split=splits > 1), combine=combine
        )

    def call(i: int) -> Callable[[], torch.Tensor]:
        return lambda: paged_attention(
            queries[i], k_cache, v_cache, tables[i], seq_lens, qsl, HEAD_DIM**-0.5, 1, ctx, splits, config
        )

    t = time_per_call([call(i) for i in range(num_sets)], device)
    return {
        "batch": batch, "ctx": ctx, "num_splits": splits, "num_sets": num_sets, "us": t * 1e6,
        "bytes": kv_bytes + qo_bytes, "tb_s": (kv_bytes + qo_bytes) / t / 1e12,
    }  # fmt: skip


def bench_decode_sdpa(batch: int, ctx: int, device: torch.device) -> dict:
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    qo_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    num_sets = _num_sets(kv_bytes)
    if not _fits(num_sets * kv_bytes * 1.1, device):
        return {"batch": batch, "ctx": ctx, "skipped": "does not fit"}
    shape = (batch, NUM_KV_HEADS, ctx, HEAD_DIM)
    sets = [
        (
            torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device=device, dtype=DTYPE),
            torch.randn(shape, device=device, dtype=DTYPE),
            torch.randn(shape, device=device, dtype=DTYPE),
        )
        for _ in range(num_sets)
    ]

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    t = time_per_call([call(*s) for s in sets], device)
    return {"batch": batch, "ctx": ctx, "us": t * 1e6, "tb_s": (kv_bytes + qo_bytes) / t / 1e12}


def bench_decode_flex(batch: int, ctx: int, device: torch.device, kernel_options: dict | None = None) -> dict:
    """torch's flex_attention (compiled) over a paged bf16 cache: one batch-1 pool per input set in the
    layout flex reads (`[1, Hkv, pages * 16, D]`), and a block mask whose KV blocks are the pages of each
    sequence's shuffled block table (scripts/flex_paged.py)."""
    from scripts.flex_paged import flex_paged_decode, paged_block_mask

    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    qo_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    num_sets = _num_sets(kv_bytes)
    if not _fits(num_sets * kv_bytes * 1.2, device):
        return {"batch": batch, "ctx": ctx, "skipped": "does not fit"}
    pages = batch * ctx // BLOCK_SIZE
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    sets = []
    for _ in range(num_sets):
        k, v = (
            torch.randn(1, NUM_KV_HEADS, pages * BLOCK_SIZE, HEAD_DIM, device=device, dtype=DTYPE)
            for _ in "kv"
        )
        table = torch.randperm(pages, device=device).to(torch.int32).view(batch, -1)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        sets.append((query, k, v, paged_block_mask(table, seq_lens, pages, BLOCK_SIZE)))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> Callable[[], torch.Tensor]:
        return lambda: flex_paged_decode(q, k, v, mask, HEAD_DIM**-0.5, kernel_options)

    t = time_per_call([call(*st) for st in sets], device)
    return {"batch": batch, "ctx": ctx, "us": t * 1e6, "tb_s": (kv_bytes + qo_bytes) / t / 1e12,
            "kernel_options": kernel_options}  # fmt: skip


def flex_table(shapes: list[tuple[int, int]], device: torch.device, copy_bw: float) -> list[dict]:
    """flex_attention on a paged cache at some of the decode table's shapes (each shape compiles anew); the
    default kernel options first, then 16-token KV tiles (the page size) if those fail."""
    rows = []
    print("\n| batch | context | flex us | flex % copy | kernel options |\n|---:|---:|---:|---:|---|")
    for b, ctx in shapes:
        row = _attempt(f"flex {b}x{ctx}", bench_decode_flex, b, ctx, device)
        if "skipped" in row and row["skipped"] != "does not fit":
            row = _attempt(f"flex {b}x{ctx} BLOCK_N 16", bench_decode_flex, b, ctx, device, {"BLOCK_N": 16})
        row.update(batch=b, ctx=ctx)
        rows.append(row)
        if "skipped" not in row:
            row["frac"] = row["tb_s"] * 1e12 / copy_bw
            print(
                f"| {b} | {ctx} | {row['us']:.1f} | {100 * row['frac']:.0f}% | {row['kernel_options']} |",
                flush=True,
            )
        else:
            print(f"| {b} | {ctx} | skipped: {row['skipped']} | | |", flush=True)
    return rows


def bench_prefill(
    prompt_len: int, total_tokens: int, device: torch.device, config: AttentionConfig | None = None
):
    """Full causal prefill of total_tokens // prompt_len prompts: Triton (paged) and SDPA (contiguous)."""
    batch = max(1, total_tokens // prompt_len)
    num_tokens = batch * prompt_len
    flops = 4 * NUM_HEADS * HEAD_DIM * batch * prompt_len * (prompt_len + 1) / 2
    gen = torch.Generator().manual_seed(prompt_len)
    k_cache, v_cache, tables = _paged_inputs(2, batch, prompt_len, device, gen)
    queries = [torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(2)]
    seq_lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, num_tokens + 1, prompt_len, dtype=torch.int32, device=device)

    def call(i: int) -> Callable[[], torch.Tensor]:
        return lambda: paged_attention(
            queries[i], k_cache, v_cache, tables[i], seq_lens, qsl, HEAD_DIM**-0.5, prompt_len, prompt_len,
            config=config,
        )  # fmt: skip

    t = time_per_call([call(0), call(1)], device)
    row = {"prompt_len": prompt_len, "batch": batch, "us": t * 1e6, "tflops": flops / t / 1e12}
    if config is None:
        q = torch.randn(batch, NUM_HEADS, prompt_len, HEAD_DIM, device=device, dtype=DTYPE)
        k, v = (
            torch.randn(batch, NUM_KV_HEADS, prompt_len, HEAD_DIM, device=device, dtype=DTYPE) for _ in "kv"
        )
        t_sdpa = time_per_call(
            [lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)], device
        )
        row["sdpa_tflops"] = flops / t_sdpa / 1e12
    return row


def bench_cache_ops(device: torch.device, num_tokens: int, num_layers: int, num_pairs: int) -> dict:
    """write_kv (Triton vs the reference's index_put) and copy_blocks over an all-layer pool (Triton vs
    PyTorch's index_select + index_copy_, as worker/kv_cache.py does it), as bytes moved per second."""
    num_blocks = 2 * max(num_tokens // BLOCK_SIZE, num_pairs)
    pool = torch.randn(
        num_layers, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE
    )
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE) for _ in "kv")
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    kv_bytes = 2 * 2 * key.numel() * DTYPE.itemsize  # K and V, read and written
    t_triton = time_per_call([lambda: cache_ops.write_kv(key, value, k_cache, v_cache, slots)], device)
    t_torch = time_per_call([lambda: reference.write_kv(key, value, k_cache, v_cache, slots)], device)
    perm = torch.randperm(num_blocks, device=device)
    src, dst = perm[:num_pairs], perm[num_pairs : 2 * num_pairs]
    copy_bytes = 2 * pool[:, :, :num_pairs].numel() * DTYPE.itemsize  # each pair read once and written once
    t_copy = time_per_call([lambda: cache_ops.copy_blocks(pool, src, dst)], device)
    t_copy_torch = time_per_call([lambda: pool.index_copy_(2, dst, pool.index_select(2, src))], device)
    return {
        "write_kv_tokens": num_tokens, "write_kv_triton_tb_s": kv_bytes / t_triton / 1e12,
        "write_kv_torch_tb_s": kv_bytes / t_torch / 1e12, "write_kv_triton_us": t_triton * 1e6,
        "write_kv_torch_us": t_torch * 1e6, "copy_blocks_layers": num_layers, "copy_blocks_pairs": num_pairs,
        "copy_blocks_us": t_copy * 1e6, "copy_blocks_tb_s": copy_bytes / t_copy / 1e12,
        "copy_blocks_torch_us": t_copy_torch * 1e6,
        "copy_blocks_torch_tb_s": copy_bytes / t_copy_torch / 1e12,
    }  # fmt: skip


def _attempt(label: str, fn: Callable[..., dict], *args, **kwargs) -> dict:
    """fn(*args, **kwargs); a failure (out of memory, a config that does not compile) becomes a note."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - one bad shape must not lose the rest of the run
        print(f"  {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"skipped": f"{type(e).__name__}"}


def decode_table(batches: list[int], contexts: list[int], device: torch.device, copy_bw: float) -> list[dict]:
    rows = []
    print("\n| batch | context | splits | triton us | triton TB/s | triton % copy | sdpa us | sdpa % copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        for ctx in contexts:
            row = _attempt(f"decode {b}x{ctx}", bench_decode, b, ctx, device)
            row.update(batch=b, ctx=ctx)
            rows.append(row)
            if "skipped" in row:
                print(f"| {b} | {ctx} | skipped: {row['skipped']} |", flush=True)
                continue
            sd = _attempt(f"sdpa {b}x{ctx}", bench_decode_sdpa, b, ctx, device)
            row.update(frac=row["tb_s"] * 1e12 / copy_bw)
            if "skipped" not in sd:
                row.update(sdpa_us=sd["us"], sdpa_tb_s=sd["tb_s"], sdpa_frac=sd["tb_s"] * 1e12 / copy_bw)
            print(
                f"| {b} | {ctx} | {row['num_splits']} | {row['us']:.1f} | {row['tb_s']:.2f} | "
                f"{100 * row['frac']:.0f}% | {row.get('sdpa_us', float('nan')):.1f} | "
                f"{100 * row.get('sdpa_frac', float('nan')):.0f}% |", flush=True,
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def prefill_table(prompt_lens: list[int], total_tokens: int, device: torch.device, mm: float) -> list[dict]:
    rows = []
    print("\n| prompt | prompts | triton us | triton TFLOP/s | % matmul | sdpa TFLOP/s | sdpa % matmul |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in prompt_lens:
        row = _attempt(f"prefill {n}", bench_prefill, n, total_tokens, device)
        rows.append(row)
        if "skipped" not in row:
            print(
                f"| {n} | {row['batch']} | {row['us']:.0f} | {row['tflops']:.0f} | "
                f"{100 * row['tflops'] * 1e12 / mm:.0f}% | {row['sdpa_tflops']:.0f} | "
                f"{100 * row['sdpa_tflops'] * 1e12 / mm:.0f}% |", flush=True,
            )  # fmt: skip
    return rows


def main() -> None:
    global HEAD_DIM, KV_LAYOUT, MAX_SETS, KV_DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    ap.add_argument("--sweep", action="store_true", help="also sweep split counts and tile shapes")
    ap.add_argument("--cache-ops-only", action="store_true", help="only the ceilings and the cache ops")
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only the copy ceiling, the decode table, and batch-1/8 splits with fused/separate combine",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument(
        "--flex",
        action="store_true",
        help="with --decode-only: flex_attention over a paged cache at four shapes, after the decode table",
    )
    ap.add_argument("--no-extras", action="store_true", help="with --decode-only: skip the splits and probes")
    ap.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help="64: the Llama-3.2-1B shape's heads; 96: Phi-3-mini's (padded to 128 in registers); any "
        "multiple of 8 up to 256",
    )
    ap.add_argument(
        "--kv-layout",
        choices=["head", "token"],
        default=KV_LAYOUT,
        help="blocks in memory: head-major (the worker's) or token-major [num_blocks, block_size, Hkv, D]",
    )
    ap.add_argument(
        "--kv-dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help="the paged pools (fp8: float8 e4m3, half the bytes; SDPA keeps a bf16 cache)",
    )
    args = ap.parse_args()
    HEAD_DIM, KV_LAYOUT = args.head_dim, args.kv_layout
    KV_DTYPE = torch.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE

    fp8 = KV_DTYPE == torch.float8_e4m3fn
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        MAX_SETS = 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    res: dict = {
        "gpu": name, "date": datetime.date.today().isoformat(), "commit": args.commit or git_commit(),
        "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": str(DTYPE), "kv_dtype": str(KV_DTYPE),
                  "kv_layout": KV_LAYOUT},
        "decode_config": decode_config(HEAD_DIM, fp8).__dict__,
        "decode_split_config": decode_config(HEAD_DIM, fp8, split=True).__dict__,
        "prefill_config": prefill_config(HEAD_DIM, fp8).__dict__,
    }  # fmt: skip
    copy_bytes = (2 << 30) if not args.smoke else (1 << 20)
    copy_bw = measure_copy_bandwidth(device, copy_bytes)
    copy_bw_graph = measure_copy_bandwidth(device, copy_bytes, graph=True)
    if args.decode_only:
        res.update(copy_tb_s=copy_bw / 1e12, copy_in_graph_tb_s=copy_bw_graph / 1e12)
        print(f"# {name}  copy {copy_bw / 1e12:.2f} TB/s", flush=True)
        batches, contexts = ([1, 8, 64, 256], [512, 2048, 8192]) if not args.smoke else ([1, 2], [64])
        res["decode"] = decode_table(batches, contexts, device, copy_bw)
        if args.flex:
            shapes = [(1, 8192), (8, 2048), (64, 2048), (256, 2048)] if not args.smoke else [(2, 64)]
            res["flex"] = flex_table(shapes, device, copy_bw)
        if not args.no_extras:
            res["combine_splits"] = combine_splits(device, copy_bw, args.smoke)
        if not args.smoke and not args.no_extras:
            res["probes"] = _attempt("probes", probes, device)
        write_json(args.out, res)
        return
    mm = measure_matmul_rate(device, 8192 if not args.smoke else 64)
    res.update(copy_tb_s=copy_bw / 1e12, copy_in_graph_tb_s=copy_bw_graph / 1e12, matmul_tflops=mm / 1e12)
    print(
        f"# {name}  copy {copy_bw / 1e12:.2f} TB/s (read+write; {copy_bw_graph / 1e12:.2f} as a graph memcpy "
        f"node)  bf16 matmul {mm / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    if not args.cache_ops_only:
        batches, contexts = ([1, 8, 64, 256], [512, 2048, 8192]) if not args.smoke else ([1, 2], [64])
        res["decode"] = decode_table(batches, contexts, device, copy_bw)
        prompt_lens = [512, 1024, 2048, 4096, 8192] if not args.smoke else [32]
        res["prefill"] = prefill_table(prompt_lens, 16384 if not args.smoke else 64, device, mm)

    sizes = (16384, 16, 512) if not args.smoke else (16, 2, 2)
    ops = res["cache_ops"] = _attempt("cache ops", bench_cache_ops, device, *sizes)
    if "skipped" not in ops:
        print(
            f"\nwrite_kv {ops['write_kv_tokens']} tokens: triton {ops['write_kv_triton_us']:.1f} us "
            f"({ops['write_kv_triton_tb_s']:.2f} TB/s), reference index_put "
            f"{ops['write_kv_torch_us']:.1f} us ({ops['write_kv_torch_tb_s']:.2f} TB/s)\n"
            f"copy_blocks {ops['copy_blocks_layers']} layers x {ops['copy_blocks_pairs']} pairs: triton "
            f"{ops['copy_blocks_us']:.1f} us ({ops['copy_blocks_tb_s']:.2f} TB/s), torch gather+scatter "
            f"{ops['copy_blocks_torch_us']:.1f} us ({ops['copy_blocks_torch_tb_s']:.2f} TB/s)", flush=True,
        )  # fmt: skip

    if not args.smoke and not args.cache_ops_only:
        res["probes"] = _attempt("probes", probes, device)
    write_json(args.out, res)  # now and again after the sweep, so a run cut short keeps the main table
    if args.sweep:
        res["sweep"] = sweep(device, copy_bw, mm, args.smoke)
        write_json(args.out, res)


def combine_splits(device: torch.device, copy_bw: float, smoke: bool) -> dict:
    """% of copy by split count with the combine fused into the attention kernel and as a second kernel."""
    shapes = [(1, 8192, [16, 32, 64]), (1, 2048, [8, 16]), (8, 2048, [4, 8]), (8, 8192, [4, 8])]
    if smoke:
        shapes = [(1, 64, [2])]
    out = []
    print("\n# decode % copy (us) by split count: fused combine / separate combine kernel")
    for b, ctx, counts in shapes:
        for s in counts:
            row: dict = {"batch": b, "ctx": ctx, "splits": s}
            for key in ("fused", "separate"):
                r = _attempt(f"{b}x{ctx}/{s}", bench_decode, b, ctx, device, num_splits=s, combine=key)
                row[f"{key}_us"] = r.get("us", float("nan"))
                row[f"{key}_frac"] = r.get("tb_s", float("nan")) * 1e12 / copy_bw
            out.append(row)
            print(
                f"{b}x{ctx} splits {s}: fused {100 * row['fused_frac']:.0f}% ({row['fused_us']:.1f} us), "
                f"separate {100 * row['separate_frac']:.0f}% ({row['separate_us']:.1f} us)", flush=True,
            )  # fmt: skip
    return out


@triton.jit
def _noop_kernel(x_ptr):  # [1]
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@triton.jit
def _paged_read_kernel(
    k_ptr, v_ptr, table_ptr, out_ptr, num_tiles, num_splits, stride_cb, stride_ct, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """Reads one sequence's K and V of one KV head through its block table, tiles dealt round-robin to the
    splits as the decode kernel deals them, and only sums them: the attention's bytes, none of its math
    (rows padded to HEAD_PAD columns in registers, masked, as the attention kernel reads them)."""
    split, head = tl.program_id(0), tl.program_id(1)
    offs_n, offs_d = tl.arange(0, TILE_N), tl.arange(0, HEAD_PAD)
    acc = tl.zeros([TILE_N, HEAD_PAD], tl.float32)
    for t in range(split, num_tiles, num_splits):
        pos = t * TILE_N + offs_n
        block = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head * stride_ch
        offs = row[:, None] + offs_d[None, :]
        k = load_rows(k_ptr + offs, pos, False, HEAD_DIM, HEAD_PAD, "evict_first")
        v = load_rows(v_ptr + offs, pos, False, HEAD_DIM, HEAD_PAD, "evict_first")
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + split * tl.num_programs(1) + head, tl.sum(acc))


def bench_paged_read(ctx: int, device: torch.device, num_splits: int, num_warps: int) -> float:
    """Microseconds to read batch 1's K/V of `ctx` tokens through its block table (`_paged_read_kernel`),
    timed like the decode kernel (same inputs, rotation and graph)."""
    kv_bytes = 2 * ctx * NUM_KV_HEADS * HEAD_DIM * KV_DTYPE.itemsize
    num_sets = _num_sets(kv_bytes)
    k_cache, v_cache, tables = _paged_inputs(num_sets, 1, ctx, device, torch.Generator().manual_seed(ctx))
    out = torch.empty(num_splits * NUM_KV_HEADS, device=device)
    tile = DECODE_CONFIG.tile_n

    def call(i: int) -> Callable[[], object]:
        return lambda: _paged_read_kernel[(num_splits, NUM_KV_HEADS)](
            k_cache, v_cache, tables[i], out, ctx // tile, num_splits,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            HEAD_DIM=HEAD_DIM, HEAD_PAD=padded_head_dim(HEAD_DIM), BLOCK_SIZE=BLOCK_SIZE, TILE_N=tile,
            num_warps=num_warps,
        )  # fmt: skip

    return time_per_call([call(i) for i in range(num_sets)], device) * 1e6


def probes(device: torch.device) -> dict:
    """Where batch-1 decode time goes: a no-op kernel in the graph, the attention kernel alone (no combine,
    neither fused nor separate), and a kernel that only reads the same bytes the same way (4 warps, as the
    attention, and 8)."""
    out: dict = {}
    x = torch.zeros(1, device=device)
    out["noop_kernel_us"] = time_per_call([lambda: _noop_kernel[(1,)](x)], device) * 1e6  # graph node
    for b, ctx in [(1, 8192), (1, 2048), (8, 2048)]:
        full = bench_decode(b, ctx, device)
        alone = bench_decode(b, ctx, device, combine="none")  # the attention kernel without any combine
        row = {"batch": b, "ctx": ctx, "splits": full["num_splits"], "us": full["us"],
               "attention_only_us": alone["us"]}  # fmt: skip
        if b == 1:
            for warps in (4, 8):
                row[f"read_only_{warps}_warps_us"] = bench_paged_read(ctx, device, full["num_splits"], warps)
        out[f"{b}x{ctx}"] = row
        print(f"probe {row}", flush=True)
    print(f"probe no-op kernel per graph node: {out['noop_kernel_us']:.2f} us", flush=True)
    return out


def sweep(device: torch.device, copy_bw: float, mm: float, smoke: bool) -> dict:
    """Split counts and tile shapes around the defaults, to tune them."""
    out: dict = {"splits": [], "decode_tiles": [], "prefill_tiles": []}
    shapes = [(1, 8192), (1, 2048), (8, 2048), (8, 8192), (64, 2048), (64, 8192), (256, 2048)]
    split_counts = [1, 2, 4, 8, 16, 32, 64]
    tile_shapes = [(1, 8192), (8, 2048), (64, 2048), (64, 8192), (256, 2048)]
    prefill_lens = [1024, 4096]
    if smoke:
        shapes, split_counts, prefill_lens = [(1, 64)], [1, 2], [32]
        tile_shapes = shapes
    print(
        "\n# sweep: decode % copy by split count\n| batch | context | "
        + " | ".join(map(str, split_counts))
        + " |"
    )
    for b, ctx in shapes:
        rows = [_attempt(f"{b}x{ctx}/{s}", bench_decode, b, ctx, device, num_splits=s) for s in split_counts]
        fr = [r.get("tb_s", float("nan")) * 1e12 / copy_bw for r in rows]
        out["splits"].append({"batch": b, "ctx": ctx, "splits": split_counts, "frac": fr})
        print(f"| {b} | {ctx} | " + " | ".join(f"{100 * f:.0f}%" for f in fr) + " |", flush=True)
    tiles = [AttentionConfig(16, tn, w, s) for tn, w, s in [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3),
             (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3)]]  # fmt: skip
    print("\n# sweep: decode tiles (% copy, automatic splits)")
    for cfg in tiles if not smoke else tiles[:1]:
        rows = [_attempt(str(cfg), bench_decode, b, ctx, device, config=cfg) for b, ctx in tile_shapes]
        fr = [r.get("tb_s", float("nan")) * 1e12 / copy_bw for r in rows]
        out["decode_tiles"].append({"config": cfg.__dict__, "frac": fr})
        print(
            f"{cfg}: "
            + " ".join(f"{b}x{c}={100 * f:.0f}%" for (b, c), f in zip(tile_shapes, fr, strict=True)),
            flush=True,
        )
    pcfgs = [AttentionConfig(m, n, w, s) for m, n, w, s in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3),
             (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 4)]]  # fmt: skip
    print("\n# sweep: prefill tiles (% matmul)")
    for cfg in pcfgs if not smoke else pcfgs[:1]:
        rows = [
            _attempt(str(cfg), bench_prefill, n, 16384 if not smoke else 64, device, cfg)
            for n in prefill_lens
        ]
        fr = [r.get("tflops", float("nan")) * 1e12 / mm for r in rows]
        out["prefill_tiles"].append({"config": cfg.__dict__, "prompt_lens": prefill_lens, "frac": fr})
        print(
            f"{cfg}: " + " ".join(f"{n}={100 * f:.0f}%" for n, f in zip(prefill_lens, fr, strict=True)),
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
