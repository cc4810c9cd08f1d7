"""Compiles the paged-attention and KV-write kernels for a GPU target on any machine (no GPU needed: Triton's
own LLVM and ptxas), and prints each variant's shared memory and a hash of its PTX (line info off).

    python scripts/compile_kernels.py --head-dims 96,128 [--variants decode,prefill] [--out kernels.json]

What it is for: the CPU tests run the kernels under Triton's interpreter, which lowers nothing, so a kernel
they pass may still fail to compile; and two checkouts' PTX hashes tell whether a change altered the code of
a variant (the head-size padding left the power-of-2 variants' PTX identical: docs/kernels.md). Runs
without the interpreter whatever TRITON_INTERPRET says. The variants use the launcher's tiles
(`kernels/attention_config.py`) for the head size and cache dtype.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: jit must build compilable functions
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # the PTX then depends on the code, not on line numbers

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedserve.kernels import cache_ops, triton_attention  # noqa: E402
from pagedserve.kernels.attention_config import decode_config, padded_head_dim, prefill_config  # noqa: E402

# name: (decode?, split-KV?, FP8 cache?, sliding window and soft-cap?)
ATTENTION_VARIANTS = {
    "decode": (True, False, False, False),
    "decode-split": (True, True, False, False),  # register prefetch, the combine in the same launch
    "decode-fp8": (True, False, True, False),
    "prefill": (False, False, False, False),
    "prefill-split": (False, True, False, False),
    "prefill-window-softcap": (False, False, False, True),
    "prefill-fp8": (False, False, True, False),
}
OTHER_VARIANTS = ("combine", "write-kv", "write-kv-fp8")
VARIANTS = (*ATTENTION_VARIANTS, *OTHER_VARIANTS)
GROUP = 4  # query heads per KV head (Llama-3-8B's)


def compile_for(fn: Any, types: dict[str, str], consts: dict, num_warps: int, num_stages: int, arch: int):
    """`fn` compiled for sm_`arch`, pointers and strides 16-divisible as the launches specialize them."""
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    constexprs: dict[str, Any] = {}
    for i, param in enumerate(fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = consts.get(param.name, param.default)
            continue
        signature[param.name] = types.get(param.name, "i32")
        if signature[param.name].startswith("*") or param.name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _attention(head_dim: int, variant: str, arch: int):
    decode, split, fp8, window = ATTENTION_VARIANTS[variant]
    pad = padded_head_dim(head_dim)
    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {
        "out_ptr": "*bf16", "query_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
        "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "counter_ptr": "*i32", "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "qk_scale": "fp32", "v_scale": "fp32",
        "softcap_log2": "fp32",
    }  # fmt: skip
    consts = dict(GROUP=GROUP, HEAD_DIM=head_dim, HEAD_PAD=pad, BLOCK_SIZE=16, IEEE_DOT=False, DOTS_FP16=fp8)
    consts |= dict(SPLIT_KV=split, DECODE_ONLY=decode, SLIDING=window, SOFTCAP=window)
    if decode:
        cfg = decode_config(pad, fp8, split=split)
        consts |= dict(BLOCK_M=cfg.block_m, BLOCK_Q=1, REGISTER_PREFETCH=cfg.register_prefetch)
        if split:
            consts |= dict(FUSED_SPLITS=4, GROUP_PAD=GROUP, COMBINE_CHUNK=4)
    else:
        cfg = prefill_config(pad, fp8)
        consts |= dict(BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // GROUP)
    consts["TILE_N"] = cfg.tile_n
    fn = triton_attention._paged_attention_kernel
    return compile_for(fn, types, consts, cfg.num_warps, cfg.num_stages, arch)


def _other(head_dim: int, variant: str, arch: int):
    pad = padded_head_dim(head_dim)
    if variant == "combine":
        types = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
        consts = dict(SPLITS_PAD=8, HEAD_DIM=head_dim, HEAD_PAD=pad)
        return compile_for(triton_attention._combine_splits_kernel, types, consts, 4, 2, arch)
    cache = "*fp8e4nv" if variant == "write-kv-fp8" else "*bf16"
    types = {
        "key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
        "slot_mapping_ptr": "*i64", "inv_k_scale": "fp32", "inv_v_scale": "fp32",
    }  # fmt: skip
    consts = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim))
    consts |= dict(BLOCK_SIZE=16, FP8=variant == "write-kv-fp8")
    return compile_for(cache_ops._write_kv_kernel, types, consts, 4, 2, arch)


def compile_variant(head_dim: int, variant: str, arch: int = 90) -> dict[str, Any]:
    """One variant compiled: its shared memory (bytes per program) and the sha256 of its PTX."""
    kernel = (_attention if variant in ATTENTION_VARIANTS else _other)(head_dim, variant, arch)
    ptx = kernel.asm["ptx"]
    return {
        "head_dim": head_dim,
        "variant": variant,
        "shared_bytes": kernel.metadata.shared,
        "ptx_sha256": hashlib.sha256(ptx.encode()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--head-dims", default="96,128", help="comma-separated head sizes (multiples of 8 <= 256)"
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for variant in variants:
            row = compile_variant(head_dim, variant, args.arch)
            print(
                f"{head_dim:4d} {variant:24s} shared {row['shared_bytes']:7d}  ptx {row['ptx_sha256'][:16]}"
            )
            rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
