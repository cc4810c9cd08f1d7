"""The PyTorch reference of kernels/nucleus.py: the same rejection rounds and fallback, batched over rows,
step by step (any device; it waits for the device between rounds, so the worker uses it on the CPU only).
The algorithm and its proof of exactness are in kernels/nucleus.py's docstring."""

from __future__ import annotations

import torch


def sort_keys(x: torch.Tensor) -> torch.Tensor:  # [n, V] float32 -> [n, V] int64
    """The stable descending sort's order as int64 keys: the float's order in the high half, minus the
    token id in the low half (larger key first, equal logits by smaller id)."""
    bits = x.view(torch.int32)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ids = torch.arange(x.shape[-1], device=x.device)
    return (bits.to(torch.int64) << 32) - ids


def _locate(p: torch.Tensor, inside: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order over `inside` ([n, V] bool): the first token whose float64
    cumulative mass exceeds target [n], else the last token with mass."""
    vocab = p.shape[-1]
    ids = torch.arange(vocab, device=p.device)
    q = torch.where(inside, p, 0.0)
    cdf = q.cumsum(dim=-1)
    first = torch.where((cdf > target[:, None]) & (q > 0), ids, vocab).amin(dim=-1)
    last = torch.where(q > 0, ids, -1).amax(dim=-1)
    return torch.minimum(first, last).clamp_(min=0)


def draw_nucleus_reference(
    logits: torch.Tensor,  # [R, V] any float dtype
    rows: torch.Tensor,  # [n] int64
    temperature: torch.Tensor,  # [n] float32, > 0
    top_k: torch.Tensor,  # [n] int64, <= 0: off
    top_p: torch.Tensor,  # [n] float32 in (0, 1]
    uniforms: torch.Tensor,  # [n, rounds + 1] float64
) -> torch.Tensor:  # [n] int64
    """`kernels.nucleus.draw_nucleus`, in PyTorch."""
    n, rounds = len(rows), uniforms.shape[1] - 1
    x = logits.index_select(0, rows).float() / temperature[:, None]
    x = torch.where(x.isnan(), float("-inf"), x + 0.0)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = (x - m).exp_().double()  # float32 exp, float64 sums
    key = sort_keys(x)
    total = p.sum(dim=-1)
    threshold = top_p.double() * total
    top_k = top_k.to(torch.int64)

    bound = torch.full((n,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=x.device)
    mass_c = total
    token = torch.zeros(n, dtype=torch.int64, device=x.device)
    done = torch.zeros(n, dtype=torch.bool, device=x.device)
    for r in range(rounds):
        if bool(done.all()):
            break
        t = _locate(p, key > bound[:, None], uniforms[:, r] * mass_c)
        kt = key.gather(1, t[:, None])  # [n, 1]
        above = key > kt
        mass = torch.where(above, p, 0.0).sum(dim=-1)
        rank = above.sum(dim=-1)
        ok = (mass < threshold) & ((top_k <= 0) | (rank < top_k))
        token = torch.where(ok & ~done, t, token)
        done |= ok
        bound, mass_c = kt[:, 0], mass
    if not bool(done.all()):
        # The nucleus directly, from a stable sort: the prefix whose mass and count before each token pass.
        left = (~done).nonzero()[:, 0]
        order = key[left].argsort(dim=-1, descending=True)
        ps = p[left].gather(1, order)
        mass_before = torch.nn.functional.pad(ps.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive
        rank = torch.arange(p.shape[-1], device=p.device)[None, :]
        k = top_k[left, None]
        keep_sorted = (mass_before < threshold[left, None]) & ((k <= 0) | (rank < k))
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        mass_s = torch.where(keep, p[left], 0.0).sum(dim=-1)
        token[left] = _locate(p[left], keep, uniforms[left, rounds] * mass_s)
    return token
