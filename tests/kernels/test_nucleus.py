"""Top-p / top-k draws without a sort (kernels/nucleus.py): the Triton kernel (interpreted on the CPU) against
its PyTorch reference, both against the truncated, renormalized softmax computed by sorting in float64
(chi-square), reproducibility, and the sampler's CUDA path (worker/nucleus_draw.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.common.messages import SamplingParams
from pagedserve.kernels.nucleus import draw_nucleus
from pagedserve.kernels.reference_nucleus import draw_nucleus_reference
from pagedserve.worker.nucleus_draw import round_uniforms_for
from pagedserve.worker.sampler import SamplingRow, SamplingTensors, sample_tensors, uniforms_for


def _truncated(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a draw must follow, by a float64 stable sort: softmax, the top_k first tokens, then a
    token dropped when the tokens before it hold top_p of the mass; renormalized."""
    x = logits.double() / temperature
    values, ids = x.sort(descending=True, stable=True)
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep = before < top_p
    if top_k > 0:
        keep &= torch.arange(len(x)) < top_k
    out = torch.zeros_like(x)
    out[ids[keep]] = probs[keep]
    return out / out.sum()


def _chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    n = counts.sum()
    assert (counts[expected == 0] == 0).all(), "a token outside the truncated set was drawn"
    inside = expected > 0
    return float((((counts - n * expected) ** 2)[inside] / (n * expected[inside])).sum())


def _inputs(n: int, vocab: int, seed: int, spread: float = 2.0, coarse: bool = False) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * spread
    if coarse:  # ties, as bfloat16 logits have, also across the cut
        logits = (logits * 2).round() / 2
    logits[torch.rand(n, vocab, generator=g) < 0.1] = float("-inf")  # min_p's and bans' cuts
    rows = torch.randperm(n, generator=g)
    temperature = torch.rand(n, generator=g) + 0.3
    top_k = torch.where(torch.rand(n, generator=g) < 0.5, torch.randint(1, vocab + 5, (n,), generator=g), 0)
    top_p = torch.where(torch.rand(n, generator=g) < 0.8, torch.rand(n, generator=g) * 0.95 + 0.05, 1.0)
    return logits, rows, temperature, top_k, top_p


LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, float("-inf"), 0.7, 1.5, 1.5, -2.0])
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 0.7),
    (0.7, 0, 0.95),
    (1.3, 4, 0.9),
    (1.0, 3, 1.0),
    (1.0, 0, 0.01),  # only the most likely token
]


@pytest.mark.parametrize("rounds", [1, 8])
@pytest.mark.parametrize("case", CASES)
def test_reference_draws_follow_the_truncated_softmax(case: tuple, rounds: int) -> None:
    temperature, top_k, top_p = case
    n = 20000
    uniforms = torch.from_numpy(round_uniforms_for(uniforms_for, np.full(n, 77), np.arange(n), rounds))
    tokens = draw_nucleus_reference(
        LOGITS[None].expand(n, -1),
        torch.zeros(n, dtype=torch.int64),
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        uniforms,
    )
    # At most 9 degrees of freedom: chi-square 35 has p < 1e-4 there; a few percent off lands in the hundreds.
    assert _chi_square(tokens, _truncated(LOGITS, temperature, top_k, top_p)) < 35.0


@pytest.mark.parametrize("case", CASES[:3])
def test_kernel_draws_follow_the_truncated_softmax(case: tuple) -> None:
    temperature, top_k, top_p = case
    n = 600  # the interpreter runs a program in about 20 ms
    uniforms = torch.from_numpy(round_uniforms_for(uniforms_for, np.full(n, 5), np.arange(n)))
    tokens = draw_nucleus(
        LOGITS[None].expand(n, -1).contiguous(),
        torch.zeros(n, dtype=torch.int64),
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        uniforms,
    )
    assert _chi_square(tokens, _truncated(LOGITS, temperature, top_k, top_p)) < 35.0


@pytest.mark.parametrize(("rounds", "coarse", "block"), [(8, False, 64), (8, True, 32), (1, True, 128)])
def test_kernel_equals_reference(rounds: int, coarse: bool, block: int) -> None:
    """Rejection rounds, the bisection fallback (forced often with one round), ties, several tiles."""
    n, vocab = (24, 200) if rounds > 1 else (8, 130)
    logits, rows, temperature, top_k, top_p = _inputs(n, vocab, seed=rounds + block, coarse=coarse)
    uniforms = torch.rand(n, rounds + 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    args = (logits, rows, temperature, top_k, top_p, uniforms)
    got = draw_nucleus(*args, block=block)
    assert got.tolist() == draw_nucleus_reference(*args).tolist()
    # Every draw lies in its row's truncated set.
    for j in range(n):
        allowed = _truncated(logits[int(rows[j])], float(temperature[j]), int(top_k[j]), float(top_p[j])) > 0
        assert allowed[got[j]]


def test_draws_repeat_and_do_not_depend_on_the_batch() -> None:
    """Same (logits, parameters, uniforms) -> same token: across calls, across batch compositions (as on
    each tensor-parallel rank, which samples the same gathered logits with the same seeds)."""
    n, vocab = 16, 150
    logits, rows, temperature, top_k, top_p = _inputs(n, vocab, seed=9)
    uniforms = torch.from_numpy(round_uniforms_for(uniforms_for, np.arange(n) * 7919, np.arange(n) + 3))
    first = draw_nucleus(logits, rows, temperature, top_k, top_p, uniforms, block=64)
    assert (
        draw_nucleus(logits, rows, temperature, top_k, top_p, uniforms, block=64).tolist() == first.tolist()
    )
    pick = torch.tensor([5, 0, 11])
    some = draw_nucleus(
        logits, rows[pick], temperature[pick], top_k[pick], top_p[pick], uniforms[pick], block=64
    )
    assert some.tolist() == first[pick].tolist()


def test_round_zero_is_the_plain_draws_uniform() -> None:
    seed, position = np.array([1, 2**63, 12345], dtype=np.uint64), np.array([0, 7, 4095])
    table = round_uniforms_for(uniforms_for, seed, position, rounds=3)
    assert table[:, 0].tolist() == uniforms_for(seed, position).tolist()
    for r in range(1, 4):
        assert table[:, r].tolist() == uniforms_for(seed, position + r * 2**48).tolist()
    assert len({*table.reshape(-1).tolist()}) == table.size  # the rounds draw afresh


def test_sampler_cuda_path_draws_inside_the_nucleus() -> None:
    """sample_tensors with round uniforms (what from_arrays builds on CUDA) takes the kernel, here interpreted
    on the CPU: every top-p row draws inside its nucleus, as the reference does, and the other groups are
    untouched."""
    rng = random.Random(4)
    vocab = 96
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9, 0.5]))
        for _ in range(12)
    ]
    rows = [SamplingRow(p, seed=rng.randrange(2**63), position=rng.randrange(4096)) for p in params]
    tensors = SamplingTensors.from_rows(rows, "cpu")
    assert tensors.round_uniforms is None  # the CPU keeps its sort
    seeds = np.array([r.seed for r in rows], dtype=np.uint64)[tensors.order.numpy()]
    positions = np.array([r.position for r in rows])[tensors.order.numpy()]
    table = torch.from_numpy(round_uniforms_for(uniforms_for, seeds, positions))
    on_gpu_path = sample_tensors(logits, replace(tensors, round_uniforms=table)).tokens
    on_cpu_path = sample_tensors(logits, tensors).tokens
    for i, row in enumerate(rows):
        if not row.filtered or row.greedy:
            assert on_gpu_path[i] == on_cpu_path[i]
            continue
        slot = tensors.order.tolist().index(i)
        expected = draw_nucleus_reference(
            logits,
            torch.tensor([i]),
            torch.tensor([row.temperature], dtype=torch.float32),
            torch.tensor([row.top_k]),
            torch.tensor([row.top_p], dtype=torch.float32),
            table[slot : slot + 1],
        )
        assert on_gpu_path[i] == expected[0]
        assert _truncated(logits[i], row.temperature, row.top_k, row.top_p)[on_gpu_path[i]] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_kernel_matches_the_reference_and_never_waits() -> None:
    device = torch.device("cuda")
    n, vocab = 256, 128256
    logits, rows, temperature, top_k, top_p = (t.to(device) for t in _inputs(n, vocab, seed=21, coarse=True))
    logits = logits.to(torch.bfloat16)
    uniforms = torch.rand(n, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    expected = draw_nucleus_reference(logits, rows, temperature, top_k, top_p, uniforms)
    draw_nucleus(logits, rows, temperature, top_k, top_p, uniforms)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = draw_nucleus(logits, rows, temperature, top_k, top_p, uniforms)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The GPU's exp and the float64 sums in another order move the boundaries by ~1e-7 of the mass: a draw
    # close to one can differ from the reference's, but nearly all must agree, and all lie in the nucleus.
    assert (got == expected).float().mean().item() >= 0.95
    logits, got = logits.float().cpu(), got.cpu()
    inside = [
        _truncated(logits[int(rows[j])], float(temperature[j]), int(top_k[j]), float(top_p[j]))[got[j]] > 0
        for j in range(n)
    ]
    assert sum(inside) >= n - 1


_COMPILE = """
from scripts.compile_kernels import compile_for  # first: it drops TRITON_INTERPRET before Triton loads
from pagedserve.kernels import nucleus, processors

types = {"out_ptr": "*i64", "logits_ptr": "*bf16", "rows_ptr": "*i64", "temperature_ptr": "*fp32"}
types |= {"top_k_ptr": "*i64", "top_p_ptr": "*fp32", "uniforms_ptr": "*fp64"}
assert compile_for(nucleus._nucleus_kernel, types, dict(ROUNDS=8, BLOCK=2048), 8, 1, 90).asm["cubin"]
types = {"out_ptr": "*fp32", "rows_ptr": "*i64", "slots_ptr": "*i64", "counts_ptr": "*i32"}
types |= {"prompt_ptr": "*u8", "presence_ptr": "*fp32", "frequency_ptr": "*fp32", "repetition_ptr": "*fp32"}
assert compile_for(processors._penalize_kernel, types, dict(BLOCK=2048), 8, 1, 90).asm["cubin"]
types = {"out_ptr": "*fp32", "rows_ptr": "*i64", "shift_ptr": "*fp32"}
assert compile_for(processors._min_p_kernel, types, dict(BLOCK=2048), 8, 1, 90).asm["cubin"]
"""


def test_the_sampling_kernels_compile_for_hopper() -> None:
    """The interpreter lowers nothing: the three sampling kernels compiled for sm90 down to the cubin, as the
    worker launches them (scripts/compile_kernels.py's helper, in a process without the interpreter)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, cwd=root
    )
    if done.returncode and "No module named 'triton.backends.nvidia" in done.stderr:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert done.returncode == 0, done.stderr[-4000:]
