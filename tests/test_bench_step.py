"""scripts/bench_step.py profiles decode steps, and with --prefill-len mixed steps, on a real runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_step import kernel_group, main


@pytest.mark.parametrize("prefill_len", [0, 24])
def test_bench_step_times_decode_or_mixed_steps(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], prefill_len: int
) -> None:
    out = tmp_path / "step.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "3", "--context", "20"]
    argv += ["--steps", "4", "--max-num-batched-tokens", "64", "--prefill-len", str(prefill_len)]
    assert main([*argv, "--json-out", str(out)]) == 0

    (row,) = json.loads(out.read_text())
    assert row["mode"] == "eager" and row["fused_ops"] is False  # the CPU: no graphs, the PyTorch ops
    assert row["piecewise_graphs"] is False
    assert (row["batch"], row["context"], row["prefill_len"]) == (3, 20, prefill_len)
    assert row["step_wall_ms"] > 0 and row["scheduler_ms"] > 0
    assert row["gpu_ms"] == 0 and row["gpu_busy"] is None  # no CUDA events on the CPU
    table = capsys.readouterr().out
    assert f"| eager | none | 3 | 20 | {prefill_len} |" in table


def test_kernels_are_grouped_by_what_they_do() -> None:
    assert kernel_group("_paged_attention_kernel") == "attention"
    assert kernel_group("_combine_splits_kernel") == "attention"
    assert kernel_group("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kernel_group("_rms_norm_kernel") == "rmsnorm/rope/silu"
    assert kernel_group("_write_kv_kernel") == "kv write"
    assert kernel_group("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_group("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == (
        "sampler and other"
    )


def test_kernel_profile_needs_cuda(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "2", "--context", "8"]
    argv += ["--steps", "2"]
    assert main([*argv, "--kernels", "2", "--json-out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["kernels"] is None  # nothing to trace on the CPU; the timings are still there
    assert row["step_wall_ms"] > 0


def test_bench_step_compares_fp8_weights_with_the_checkpoint_dtype(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step.json"
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "2", "--context", "8"]
    argv += ["--steps", "2", "--quantizations", "none,fp8", "--load-format", "dummy"]
    assert main([*argv, "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["quantization"]) for r in rows] == [("eager", "none"), ("eager", "fp8")]
    table = capsys.readouterr().out
    assert "| eager | fp8 | 2 | 8 | 0 |" in table and "step time vs none" in table


def test_bench_step_refuses_unknown_weight_formats(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir), "--device", "cpu", "--quantizations", "none,awq"])


def test_fp8_kernels_are_grouped_apart_from_the_other_products() -> None:
    assert kernel_group("_quantize_rows_kernel") == "fp8 quant"
    assert kernel_group("void cutlass::device_kernel<f8f8bf16_rowwise_sm90>") == "matmul"
