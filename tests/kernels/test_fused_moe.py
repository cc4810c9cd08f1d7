"""The fused MoE kernel (kernels/fused_moe.py) against its PyTorch reference (kernels/reference_moe.py), and
the alignment of (token, slot) pairs by expert that it runs on.

Under the interpreter the sizes stay small and the dtypes are float32 and float16 (the interpreter has no
bfloat16 matrix product); the GPU tests add bfloat16 at Qwen3-30B-A3B's and Mixtral's expert shapes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.kernels import fused_moe, reference_moe
from pagedserve.worker.models.moe import SparseMoE
from tests.kernels.conftest import gpu
from tests.test_gpu_graphs import _generate as _gpu_generate
from tests.test_gpu_graphs import _runner as _gpu_runner
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner
from tests.test_moe import make_tiny_moe

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
}


def _case(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype, device, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = rand(num_tokens, hidden)
    w13 = rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = rand(num_experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = reference_moe.route(logits, top_k, renormalize=seed % 2 == 0)
    return x, w13, w2, weights, ids


def _check(case: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    out = fused_moe.fused_moe(*case)
    want = reference_moe.fused_moe(*case)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"),
    [(1, 4, 2), (7, 4, 2), (13, 8, 3), (37, 6, 1), (5, 16, 4), (70, 3, 3)],  # some experts idle, some full
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_reference(
    device: torch.device, num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype
) -> None:
    # hidden 48 and intermediate 40: neither a multiple of the tiles, so every edge is masked
    _check(_case(num_tokens, num_experts, top_k, 48, 40, dtype, device, seed=num_tokens), dtype)


def test_a_token_routed_to_one_expert_only_and_no_tokens(device: torch.device) -> None:
    x, w13, w2, weights, ids = _case(9, 5, 2, 32, 16, torch.float32, device, seed=3)
    ids = torch.full_like(ids, 4)  # every slot on the last expert: the others have no rows at all
    _check((x, w13, w2, weights, ids), torch.float32)
    empty = fused_moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"), [(1, 8, 2, 16), (13, 4, 3, 4), (40, 128, 8, 16)]
)
def test_alignment_groups_every_pair_by_expert_in_padded_blocks(
    num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    sorted_ids, block_expert, num_padded = fused_moe.align_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert (
        int(num_padded)
        == used
        <= sorted_ids.numel()
        == fused_moe.max_padded_rows(num_pairs, num_experts, block_m)
    )
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_ids[used:] == num_pairs).all()  # the unused tail is padding
    for b in range(used // block_m):  # every block holds pairs of its own expert only
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert rows.numel() and (ids.flatten()[rows] == block_expert[b]).all()


# ---------------------------------------------------------------------------------------------------------
# Full shapes on the GPU


@pytest.mark.parametrize(
    ("num_experts", "top_k", "hidden", "inter"), [(128, 8, 2048, 768), (8, 2, 4096, 14336 // 8)]
)  # Qwen3-30B-A3B's experts; Mixtral-8x7B's with a tensor-parallel split of 8
@pytest.mark.parametrize("num_tokens", [1, 16, 257, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
def test_gpu_full_shapes(
    num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int, dtype
) -> None:
    _check(_case(num_tokens, num_experts, top_k, hidden, inter, dtype, "cuda", seed=num_tokens), dtype)


@gpu
def test_gpu_kernel_is_captured_by_a_cuda_graph() -> None:
    """No host sync in the launcher: it captures, and a replay with other routing gives the new answer."""
    x, w13, w2, weights, ids = _case(8, 16, 4, 256, 128, torch.bfloat16, "cuda", seed=1)
    fused_moe.fused_moe(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    ids.copy_(torch.randint(0, 16, ids.shape, device="cuda"))
    graph.replay()
    torch.testing.assert_close(
        out.float(), reference_moe.fused_moe(x, w13, w2, weights, ids).float(), **TOL[torch.bfloat16]
    )


# ---------------------------------------------------------------------------------------------------------
# The kernel in the model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_model_with_the_kernel_matches_transformers_logits(
    device: torch.device, tmp_path: Path, family: str
) -> None:
    model_dir = make_tiny_moe(tmp_path / family, family)
    runner = make_runner(model_dir, device=str(device), fused_ops=True)
    moes = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moes and all(moe._experts is fused_moe.fused_moe for moe in moes)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    driver = Driver(runner, seed=2)
    rng = random.Random(2)
    driver.add(0, _random_prompt(rng, 6, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 19, runner.vocab_size))
    driver.step({0: 6, 1: 19})
    driver.step({0: 1, 1: 1})
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


@pytest.mark.parametrize("piecewise", [False, True])
@gpu
def test_gpu_moe_model_graphs_give_the_tokens_of_eager_execution(tmp_path: Path, piecewise: bool) -> None:
    """Decode CUDA graphs (and the piecewise graphs of mixed steps) hold the MoE layers: the same greedy
    tokens as eager execution, float32."""
    model_dir = make_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    graphs = _gpu_runner(model_dir, False, "float32", piecewise)
    eager = _gpu_runner(model_dir, True, "float32")
    assert graphs.graphs is not None and (graphs.mixed_graphs is not None) == piecewise
    rng = random.Random(3)
    prompts = [[rng.randrange(graphs.vocab_size) for _ in range(rng.randint(1, 90))] for _ in range(13)]
    max_tokens = [rng.randint(5, 30) for _ in prompts]
    results = [_gpu_generate(runner, prompts, max_tokens) for runner in (graphs, eager)]
    assert graphs.graphs.num_replays > 0
    assert results[0] == results[1]
