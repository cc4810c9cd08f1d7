"""Top-p / top-k draws without sorting the vocabulary: one Triton program per row, a loop over the
vocabulary in tiles. Its PyTorch reference, the same algorithm step by step, is kernels/reference_nucleus.py.

The row's order is the stable descending sort of its scaled logits (equal logits in vocabulary order), held
as an int64 key per token: the float's order in the high half, minus the token id in the low half, so all
keys differ and key_i > key_j exactly when i comes before j. The truncated set S (the nucleus) is the
tokens t with mass_above(t) < top_p * total and rank(t) < top_k, where mass_above and rank are the
probability mass and the number of the tokens with a larger key: S is a prefix of the order.

**Rejection rounds.** C_0 is the whole row. Round r draws t from p restricted to C_r (inverse CDF in
vocabulary order with the r-th uniform) and computes mass_above(t) and rank(t) in one more pass. If t is in
S it is the result; otherwise C_{r+1} = {tokens with a key above t's}. Since S is a prefix and t is not in
it, every token of S is above t, so S is inside every C_r, and C_r strictly shrinks.

*Exactness.* Let H_r be everything drawn before round r; it fixes C_r, which contains S. Round r's uniform is
independent of H_r, so given H_r the round draws s in S with probability p_s / p(C_r) and stops (lands in S)
with probability p(S) / p(C_r): given H_r and that it stops, the result is s with probability p_s / p(S),
whatever H_r is. The fallback, given that it is reached, draws from S itself with a uniform independent of
everything before. So the result is s with probability p_s / p(S) (up to the float rounding of the sums):
the truncated, renormalized distribution. Round r fails with probability p(C_r \\ S) / p(C_r): on the first
round 1 - p(S), at most 1 - top_p when top_k does not cut (about 0.1 at top_p 0.9), and less after, so most
rows end in one round.

**Fallback.** A row still without a token after ROUNDS rounds (the uniforms have ROUNDS + 1 columns) finds
S directly: S = {keys >= k*}, k* the smallest key k such that the mass and the count of the keys above k
pass both tests (both only grow as k falls), found by bisection over the int64 keys (64 passes at most),
then draws from p restricted to S with the last uniform. That round is independent of the earlier ones too,
so the result is exact. It runs rarely (the tests force it with few rounds).

Sums are float64 (float32 probabilities exp(x - max)), so a long vocabulary adds up accurately. A NaN logit
counts as -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_BLOCK = 2048  # a tile of the vocabulary: 128,256 columns are 63 tiles


@triton.jit
def _tile(row_ptr, start, offs, vocab, temperature, m):
    """One tile's token ids, validity, keys and float64 probabilities exp(x - m) (0 past the vocabulary)."""
    ids = start + offs
    valid = ids < vocab
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32) / temperature
    x = tl.where(x == x, x + 0.0, float("-inf"))  # NaN -> -inf; + 0.0 makes -0.0 tie with 0.0
    p = tl.where(valid, tl.exp(x - m), 0.0).to(tl.float64)
    return ids, valid, _key(x, ids), p


@triton.jit
def _key(x, ids):
    """The int64 sort key of (scaled logit, token id): larger first, equal logits by smaller id."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the floats' order as int32s
    return (bits.to(tl.int64) << 32) - ids.to(tl.int64)


@triton.jit
def _tally(row_ptr, offs, vocab, temperature, m, above_key, BLOCK: tl.constexpr):
    """Mass (float64) and number of the tokens whose key is above `above_key`."""
    mass = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK):
        ids, valid, key, p = _tile(row_ptr, start, offs, vocab, temperature, m)
        inside = valid & (key > above_key)
        mass += tl.sum(tl.where(inside, p, 0.0), axis=0)
        count += tl.sum(inside.to(tl.int64), axis=0)
    return mass, count


@triton.jit
def _locate(row_ptr, offs, vocab, temperature, m, above_key, target, BLOCK: tl.constexpr):
    """Inverse CDF in vocabulary order over the tokens whose key is above `above_key`: the first whose
    cumulative mass exceeds `target`, or the last with mass when rounding put target at the total."""
    run = tl.zeros([], tl.float64)
    first = tl.zeros([], tl.int32) + vocab
    last = tl.zeros([], tl.int32) - 1
    for start in range(0, vocab, BLOCK):
        ids, valid, key, p = _tile(row_ptr, start, offs, vocab, temperature, m)
        p = tl.where(valid & (key > above_key), p, 0.0)
        cdf = tl.cumsum(p, axis=0) + run
        first = tl.minimum(first, tl.min(tl.where((cdf > target) & (p > 0), ids, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0, ids, -1), axis=0))
        run += tl.sum(p, axis=0)
    return tl.maximum(tl.minimum(first, last), 0)


# The per-row columns arrive as views into one packed transfer, at offsets that change from step to
# step: specialized on their 16-byte alignment, each new combination compiled again inside a step
# (worker/warmup.py compiles the one variant at start).
@triton.jit(
    do_not_specialize_on_alignment=[
        "out_ptr",
        "rows_ptr",
        "temperature_ptr",
        "top_k_ptr",
        "top_p_ptr",
        "uniforms_ptr",
    ]
)
def _nucleus_kernel(
    out_ptr,  # [n] int64 drawn token ids
    logits_ptr,  # [R, V] any float dtype
    stride_row,
    rows_ptr,  # [n] int64 logits row of each slot
    temperature_ptr,  # [n] float32, > 0
    top_k_ptr,  # [n] int64, <= 0: off
    top_p_ptr,  # [n] float32 in (0, 1]
    uniforms_ptr,  # [n, ROUNDS + 1] float64 in [0, 1)
    vocab,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + tl.load(rows_ptr + slot) * stride_row
    temperature = tl.load(temperature_ptr + slot)
    top_k = tl.load(top_k_ptr + slot)
    top_p = tl.load(top_p_ptr + slot).to(tl.float64)
    u_ptr = uniforms_ptr + slot * (ROUNDS + 1)
    offs = tl.arange(0, BLOCK)

    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        x = tl.load(row_ptr + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) / temperature
        m = tl.maximum(m, tl.max(tl.where(x == x, x, float("-inf")), axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)
    floor_key = _key(tl.full([], float("-inf"), tl.float32), tl.zeros([], tl.int32) + vocab)
    total, _ = _tally(row_ptr, offs, vocab, temperature, m, floor_key, BLOCK)
    threshold = top_p * total

    bound = floor_key  # C_r: the tokens whose key is above `bound`
    mass_c = total
    token = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    r = tl.zeros([], tl.int32)
    while (done == 0) & (r < ROUNDS):
        target = tl.load(u_ptr + r) * mass_c
        t = _locate(row_ptr, offs, vocab, temperature, m, bound, target, BLOCK)
        xt = tl.load(row_ptr + t).to(tl.float32) / temperature
        xt = tl.where(xt == xt, xt + 0.0, float("-inf"))
        kt = _key(xt, t)
        mass, rank = _tally(row_ptr, offs, vocab, temperature, m, kt, BLOCK)
        ok = (mass < threshold) & ((top_k <= 0) | (rank < top_k))
        token = tl.where(ok, t, token)
        done = ok.to(tl.int32)
        bound = kt
        mass_c = mass
        r += 1

    # Fallback: the smallest key k* whose keys above pass both tests, by bisection (no-op when done).
    hi = _key(tl.full([], float("inf"), tl.float32), tl.zeros([], tl.int32))
    lo = tl.where(done != 0, hi, floor_key)
    while lo < hi:
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        mass, count = _tally(row_ptr, offs, vocab, temperature, m, mid, BLOCK)
        ok = (mass < threshold) & ((top_k <= 0) | (count < top_k))
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    if done == 0:
        mass_s, _ = _tally(row_ptr, offs, vocab, temperature, m, lo - 1, BLOCK)
        target = tl.load(u_ptr + ROUNDS) * mass_s
        token = _locate(row_ptr, offs, vocab, temperature, m, lo - 1, target, BLOCK)
    tl.store(out_ptr + slot, token.to(tl.int64))


def draw_nucleus(
    logits: torch.Tensor,  # [R, V] any float dtype, rows contiguous
    rows: torch.Tensor,  # [n] int64 logits row of each draw
    temperature: torch.Tensor,  # [n] float32, > 0
    top_k: torch.Tensor,  # [n] int64, <= 0: off
    top_p: torch.Tensor,  # [n] float32 in (0, 1]
    uniforms: torch.Tensor,  # [n, rounds + 1] float64: one per rejection round, the last for the fallback
    block: int = DEFAULT_BLOCK,
    num_warps: int = 8,
) -> torch.Tensor:  # [n] int64 token ids
    """Each row's draw from its softmax(logits / temperature) cut to top_k and top_p (module docstring)."""
    n, vocab = len(rows), logits.shape[-1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    assert logits.stride(-1) == 1 and uniforms.is_contiguous() and uniforms.dtype == torch.float64
    block = min(block, triton.next_power_of_2(vocab))
    _nucleus_kernel[(n,)](
        out,
        logits,
        logits.stride(0),
        rows,
        temperature,
        top_k,
        top_p,
        uniforms,
        vocab,
        ROUNDS=uniforms.shape[1] - 1,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out
