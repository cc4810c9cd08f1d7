"""FP8 products with the quantization in Triton (kernels/fp8_quant.py) and fused into the RMSNorm and the
SiLU-and-mul before the projections (worker/models/layers.py FP8_EPILOGUES): the same bits as the PyTorch
path they replace, in the FP8 linear alone and through a whole model.

On the CPU these run where torch has a row-wise `_scaled_mm` (with `fp8_matmul_supported` widened to the
CPU, as tests/test_fp8_weights.py does) and the kernels under TRITON_INTERPRET=1; the GPU tests run them on
Hopper."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import fp8_quant, fused_ops
from pagedserve.worker.models import fp8_linear, layers
from pagedserve.worker.models.fp8_linear import Fp8Activation, quantize_rows, scaled_mm_per_token
from tests.kernels.conftest import INTERPRET, gpu
from tests.test_fp8_weights import save_biased_llama
from tests.test_model_runner import Driver, _random_prompt, make_runner

FP8 = torch.float8_e4m3fn


def _cpu_scaled_mm() -> bool:
    try:
        one = torch.ones(16, 16).to(FP8)
        torch._scaled_mm(
            one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_fp8 = pytest.mark.skipif(
    not INTERPRET or not _cpu_scaled_mm(), reason="needs TRITON_INTERPRET=1 and torch's _scaled_mm on the CPU"
)


def _before(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
    """`scaled_mm_per_token` as it was before the Triton kernel: seven eager ops and a float32 copy. Its
    `/ 448.0` ran on CUDA as a product with float32(1 / 448) (PyTorch's division by a scalar there), written
    out here so that the CPU computes what the GPU did."""
    x2 = x.reshape(-1, x.shape[-1])
    inv = torch.tensor(1.0) / torch.tensor(448.0)
    x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() * inv.item()).clamp(min=1e-12)
    xq = (x2.float() / x_scale).clamp(-448.0, 448.0).to(FP8)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _fp8_weight(rows: int, cols: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    q, scale = quantize_rows(torch.randn(rows, cols, generator=gen, device=device) * 0.05)
    return q, scale.reshape(1, -1).contiguous()


@needs_cpu_fp8
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fp8_product_is_unchanged_bit_for_bit(monkeypatch: pytest.MonkeyPatch, with_bias: bool) -> None:
    """The Triton quantization (as CUDA runs it), and an activation that comes quantized from the fused
    RMSNorm, give the old product's bits: [B, T, K] input, bias or not."""
    monkeypatch.setattr(fp8_linear, "quantize_activation", fp8_quant.quantize_per_token)
    weight, scale = _fp8_weight(96, 160, "cpu", seed=1)
    bias = torch.randn(96).to(torch.bfloat16) if with_bias else None
    x = (torch.randn(2, 5, 160) * 3).to(torch.bfloat16)
    x[1, 2] = 0  # a zero token
    want = _before(x, weight, scale, bias)
    assert torch.equal(scaled_mm_per_token(x, weight, scale, bias), want)

    norm_weight = torch.randn(160).to(torch.bfloat16)
    normed, _ = fused_ops.rms_norm(x.reshape(10, 160), norm_weight, 1e-5)
    q, x_scale, _ = fused_ops.rms_norm_fp8(x.reshape(10, 160), norm_weight, 1e-5)
    got = scaled_mm_per_token(Fp8Activation(q, x_scale), weight, scale, bias, torch.bfloat16)
    assert torch.equal(got, _before(normed, weight, scale, bias))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose every projection takes FP8 products (sizes that are multiples of 16), with
    q/k/v biases and random norm gains."""
    path = tmp_path_factory.mktemp("fp8act") / "llama"
    return save_biased_llama(path, intermediate_size=256, num_hidden_layers=2)


def _logits(
    model_dir: Path, device: str, epilogues: bool, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    """Every logits row of a prefill, a mixed step and decodes, bf16 with FP8 products and fused ops."""
    monkeypatch.setattr(layers, "FP8_EPILOGUES", epilogues)
    runner = make_runner(
        model_dir, device=device, dtype="bfloat16", quantization="fp8", fused_ops=True,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    layer = runner.model.layers[0]
    for proj in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert proj.fp8_matmul and proj.weight.dtype == FP8
    calls = {"rms_norm_fp8": 0, "silu_and_mul_fp8": 0}
    for name in calls:
        original = getattr(fused_ops, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(fused_ops, name, counted)
    driver = Driver(runner, seed=1)
    rng = random.Random(2)
    driver.add(0, _random_prompt(rng, 9, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 21, runner.vocab_size))
    driver.step({0: 9, 1: 21})
    driver.add(2, _random_prompt(rng, 12, runner.vocab_size))
    driver.step({0: 1, 1: 1, 2: 12})
    for _ in range(3):
        driver.step({0: 1, 1: 1, 2: 1})
    # per step and layer: the two norms before qkv_proj and gate_up_proj, SiLU-and-mul before down_proj
    steps, num_layers = 5, len(runner.model.layers)
    expected = steps * num_layers if epilogues else 0
    assert calls == {"rms_norm_fp8": 2 * expected, "silu_and_mul_fp8": expected}
    return [row for _, _, row in driver.records]


@needs_cpu_fp8
def test_fused_fp8_epilogues_give_the_unfused_logits_bit_for_bit(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def on_cpu(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> bool:
        return dtype == torch.bfloat16 and rows % 16 == 0 and cols % 16 == 0

    monkeypatch.setattr(fp8_linear, "fp8_matmul_supported", on_cpu)
    fused = _logits(llama_dir, "cpu", True, monkeypatch)
    unfused = _logits(llama_dir, "cpu", False, monkeypatch)
    assert len(fused) == len(unfused) == 2 + 3 + 3 * 3
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------------------------------------
# GPU (compute capability >= 9.0: row-wise FP8 products)

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU with row-wise FP8 products (compute capability >= 9.0)",
)


@gpu
@needs_hopper
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (256, 4096, 14336), (2048, 28672, 4096)])
def test_the_fp8_product_is_unchanged_on_the_gpu(m: int, n: int, k: int) -> None:
    """The 8B shape's projections (qkv, down, gate/up): the Triton quantization gives the old product's
    bits; and the product is within e4m3's rounding of the bf16 one with the dequantized weight: relative
    L2 error under 5% (3 mantissa bits on each activation, errors random in sign, growing like sqrt(K))."""
    weight, scale = _fp8_weight(n, k, "cuda", seed=k)
    x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
    out = scaled_mm_per_token(x, weight, scale, None)
    assert torch.equal(out, _before(x, weight, scale, None))
    expected = x.float() @ (weight.float() * scale.reshape(-1, 1)).T
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < 0.05, err


@gpu
@needs_hopper
def test_fused_fp8_epilogues_give_the_unfused_logits_on_the_gpu(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = _logits(llama_dir, "cuda", True, monkeypatch)
    unfused = _logits(llama_dir, "cuda", False, monkeypatch)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
