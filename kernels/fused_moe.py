"""The mixture-of-experts feed-forward in Triton: every token's top-k experts in two grouped GEMM launches.

1. Alignment (`align_by_expert`, PyTorch ops, no host sync): the T*K (token, slot) pairs are sorted by expert
   and each expert's run is padded to a multiple of BLOCK_M, so that every BLOCK_M rows of the sorted order
   belong to one expert. Its buffers are sized for the worst case from T, K and E alone, and the padding rows
   hold the sentinel T*K, which the GEMMs mask: under a CUDA graph the shapes stay fixed whatever the routing.
2. Gate/up GEMM with SiLU-and-mul fused (`_moe_gemm_kernel`, GATED): one program per BLOCK_M sorted rows and
   BLOCK_N columns of the intermediate, accumulating both the gate and the up rows of its expert's weights,
   writing silu(gate) * up, [T*K, I].
3. Down GEMM (the same kernel, not GATED), scaling each row by its routing weight, [T*K, H]; then the sum over
   the K slots of each token.

Blocks past the last padded row exit at once, so the grid's worst case costs little when few experts are hit.
The reference is kernels/reference_moe.py; the roundings follow it (gate and up rounded to the model dtype
before the SiLU, as transformers computes them), so float32 agrees to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fused_ops import _round


@triton.jit
def _moe_gemm_kernel(
    out_ptr,  # [T*K, N]: row t*K + k is token t's slot k
    a_ptr,  # [T, Kdim] (A_PER_TOKEN: the layer's input, shared by a token's K slots) or [T*K, Kdim]
    w_ptr,  # [E, N, Kdim], or [E, 2N, Kdim] (GATED: the gate rows, then the up rows)
    topk_weights_ptr,  # [T*K] float32 routing weights (MUL_WEIGHT)
    sorted_ids_ptr,  # [max_padded] int32: (token, slot) pairs t*K + k sorted by expert; padding = num_pairs
    block_expert_ptr,  # [max_blocks] int32: the expert of each BLOCK_M rows of sorted_ids
    num_padded_ptr,  # [1] int32: how many rows of sorted_ids are used (padding included)
    N,
    Kdim,
    num_pairs,  # T*K
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,  # rows of `a` are tokens (the first GEMM), else (token, slot) pairs
    GATED: tl.constexpr,  # out = silu(a @ gate.T) * (a @ up.T), the up rows N below the gate rows
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its routing weight
    IEEE_DOT: tl.constexpr,  # float32 products in full precision (float32 models), not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row blocks per group of the swizzled launch order (weight tiles reused in L2)
):
    pid = tl.program_id(0)
    num_blocks_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_per_group = GROUP_M * num_blocks_n
    first_m = (pid // blocks_per_group) * GROUP_M
    if first_m >= num_blocks_m:  # past the last used row block: the grid is sized for the worst case
        return
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % blocks_per_group) % group_rows
    pid_n = (pid % blocks_per_group) // group_rows
    if pid_n >= num_blocks_n:  # the last group has fewer row blocks: its tail of programs has no tile
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    row_ok = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if A_PER_TOKEN:
        a_rows = pair // TOP_K
    else:
        a_rows = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_base = w_ptr + expert * stride_we
    w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N], transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Kdim, BLOCK_K):
        k_ok = offs_k < Kdim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE_DOT:
                acc_up += tl.dot(a, w_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, w_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dt = out_ptr.dtype.element_ty
    if GATED:  # silu(gate) * up, each rounded to the model dtype as the PyTorch ops round them
        gate = _round(acc, dt)
        up = _round(acc_up, dt)
        acc = _round(_round(gate / (1.0 + tl.exp(-gate)), dt) * up, dt)
    if MUL_WEIGHT:
        acc = _round(acc, dt) * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(dt), mask=row_ok[:, None] & col_ok[None, :])


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the sorted order can take once each expert's run is padded to a multiple of block_m:
    at most min(E, T*K) experts are hit, each padding fewer than block_m rows."""
    hit = min(num_experts, num_pairs)
    return (num_pairs + hit * (block_m - 1)) // block_m * block_m


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, K]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, block_expert [max_padded / block_m] int32, num_padded [1] int32): the
    (token, slot) pairs grouped by expert, each expert's group padded to block_m rows with the sentinel T*K;
    the expert of each block of rows (0 for the unused blocks at the end, which the kernel skips); how many
    rows are used. Fixed-shape PyTorch ops only: no host sync."""
    device = topk_ids.device
    flat = topk_ids.flatten()  # [T*K]
    num_pairs = flat.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its size on the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    expert_of_sorted, order = torch.sort(flat, stable=True)  # [T*K] each
    rank = torch.arange(num_pairs, device=device) - start[expert_of_sorted]  # place within its expert's run
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_start[expert_of_sorted] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


def _tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the shapes: small row blocks when each expert gets few rows
    (decodes), larger ones for prefills; float32 keeps BLOCK_N at 64, as its gated tiles (x, gate and up,
    three stages) would not fit in shared memory at 128."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 16:
        return 16, 64, 64
    if rows_per_expert <= 64:
        return 32, 64, 64
    return 64, 64 if dtype == torch.float32 else 128, 64


def _launch(
    out: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    n: int,
    top_k: int,
    tiles: tuple[int, int, int],
    a_per_token: bool,
    gated: bool,
    mul_weight: bool,
) -> None:
    block_m, block_n, block_k = tiles
    grid = (triton.cdiv(sorted_ids.numel(), block_m) * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        out, a, w, topk_weights, sorted_ids, block_expert, num_padded,
        n, a.shape[1], out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_PER_TOKEN=a_per_token, GATED=gated, MUL_WEIGHT=mul_weight,
        IEEE_DOT=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=4,
        num_stages=2 if a.dtype == torch.float32 else 3,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, H]
    """`reference_moe.fused_moe` in two grouped GEMM launches (and the alignment's few small ops)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert w2.shape == (num_experts, hidden, inter) and topk_ids.shape == topk_weights.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    num_pairs = num_tokens * top_k
    tiles = _tiles(num_pairs, num_experts, x.dtype)
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, num_experts, tiles[0])
    weights = topk_weights.flatten().to(torch.float32).contiguous()  # [T*K]
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*K, I]
    _launch(
        act, x, w13, weights, sorted_ids, block_expert, num_padded, inter, top_k, tiles, True, True, False
    )
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*K, H]
    _launch(
        y, act, w2, weights, sorted_ids, block_expert, num_padded, hidden, top_k, tiles, False, False, True
    )
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
