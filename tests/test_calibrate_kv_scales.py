"""scripts/calibrate_kv_scales.py: per-layer FP8 KV scales measured on prompts, written where the loader
reads them, and what they buy on a checkpoint whose keys and values an unscaled FP8 cache cannot hold."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.common.config import WorkerConfig
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from scripts.calibrate_kv_scales import main, measure_kv_amax, scales_from_amax, write_scales
from scripts.check_correctness import engine_logits


def _runner(model_dir: Path, kv_cache_dtype: str) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=8,
            swap_space=0.0, kv_cache_dtype=kv_cache_dtype,
        )
    )  # fmt: skip


def _prompt(seed: int, n: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def _rescaled(tiny_model_dir: Path, out: Path, factor: float) -> Path:
    """The same function with keys and values `factor` times larger: k_proj and v_proj times factor, q_proj
    and o_proj divided by it (scores and outputs unchanged in full precision)."""
    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * factor
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / factor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


@pytest.mark.parametrize("factor", [500.0, 1 / 2000])  # keys and values near 1,500 / near 0.002
def test_calibrated_scales_keep_an_fp8_cache_close_where_unscaled_fails(
    tiny_model_dir: Path, tmp_path: Path, factor: float
) -> None:
    model = _rescaled(tiny_model_dir, tmp_path / "rescaled", factor)
    vocab = load_model_config(model).vocab_size
    prompt = _prompt(1, 45, vocab)
    full = engine_logits(_runner(model, "auto"), prompt)
    original = engine_logits(_runner(tiny_model_dir, "auto"), prompt)
    assert _rel_err(full, original) < 1e-4  # the rescaled checkpoint computes the same function

    unscaled = engine_logits(_runner(model, "fp8"), prompt)  # saturated at 448, or flushed to zero
    calibration = [_prompt(seed, 60, vocab) for seed in (2, 3, 4)]
    scales = scales_from_amax(measure_kv_amax(_runner(model, "auto"), calibration))
    calibrated_dir = tmp_path / "calibrated"
    write_scales(model, calibrated_dir, scales)
    calibrated = engine_logits(_runner(calibrated_dir, "fp8"), prompt)

    assert _rel_err(unscaled, full) > 0.3
    assert _rel_err(calibrated, full) < 0.1  # e4m3's own rounding, as with a well-scaled model


def test_the_largest_value_seen_is_stored_as_448(tiny_model_dir: Path, tmp_path: Path) -> None:
    # K is measured as the cache stores it (after RoPE): calibrated on one prompt and replayed, layer 0
    # (whose keys and values depend on the embeddings only) stores its largest |K| and |V| as exactly 448.
    # Later layers see the FP8 cache's outputs of the layers before, so theirs land on 448 or the e4m3
    # value below it, 416, where nothing saturates by much.
    prompt = _prompt(5, 50, load_model_config(tiny_model_dir).vocab_size)
    amax = measure_kv_amax(_runner(tiny_model_dir, "auto"), [prompt])
    write_scales(tiny_model_dir, tmp_path / "calibrated", scales_from_amax(amax))
    fp8 = _runner(tmp_path / "calibrated", "fp8")
    assert [(a.k_scale, a.v_scale) for a in (layer.self_attn for layer in fp8.model.layers)] == [
        pytest.approx((k / 448, v / 448), rel=1e-6) for k, v in amax
    ]
    engine_logits(fp8, prompt)
    stored = fp8.kv.device_pool.float().abs().amax(dim=(2, 3, 4, 5))  # [L, 2]
    assert stored[0].tolist() == [448.0, 448.0]
    assert ((stored == 448.0) | (stored == 416.0)).all()


def test_cli_writes_the_scales_into_the_index_and_refuses_a_calibrated_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    names = list(load_file(sharded / "model.safetensors"))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the first calibration prompt\n\nand a second, longer one than the first\n")

    out = tmp_path / "out"
    argv = ["--model", str(sharded), "--out", str(out), "--prompts", str(prompts)]
    report = main([*argv, "--json-out", str(tmp_path / "scales.json")])

    num_layers = load_model_config(sharded).num_layers
    assert report == json.loads((tmp_path / "scales.json").read_text())
    assert report["num_prompts"] == 2 and len(report["scales"]) == num_layers
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.layers.1.self_attn.v_scale"] == "kv_scales.safetensors"
    written = load_file(out / "kv_scales.safetensors")
    assert written["model.layers.1.self_attn.v_scale"].item() == pytest.approx(report["scales"][1][1])
    layer = _runner(out, "fp8").model.layers[1].self_attn  # the loader finds them through the index
    assert (layer.k_scale, layer.v_scale) == pytest.approx(tuple(report["scales"][1]))
    with pytest.raises(ValueError, match="already has KV scales"):
        main(["--model", str(out), "--out", str(tmp_path / "again")])
