"""--load-format dummy (worker/dummy_weights.py): random weights of a checkpoint's shapes, drawn by the worker
from a directory holding config.json and the tokenizer only (scripts/make_model.py --no-weights)."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedserve.common.config import WorkerConfig, parse_config
from pagedserve.common.model_source import resolve_config, resolve_model
from pagedserve.worker.dummy_weights import DUMMY_STD, init_dummy_weights
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.fp8_linear import Fp8Linear, quantize_rows
from pagedserve.worker.models.layers import RMSNorm
from pagedserve.worker.models.registry import build_model
from pagedserve.worker.parallel import ParallelContext
from scripts._servers import Honcho
from scripts.bench_throughput import main as bench_main
from scripts.bench_throughput import parse_args, parse_side
from scripts.make_model import make_model
from tests.hub_cache import add_to_hub_cache
from tests.test_cli import parse as cli_parse
from tests.test_model_runner import Driver, _random_prompt, make_runner

FAMILIES = ("tiny", "qwen3-moe-tiny", "gemma2-tiny", "phi3-tiny")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """preset -> (its checkpoint, the same preset's directory without weights)."""
    root = tmp_path_factory.mktemp("dummy")
    return {
        preset: (
            make_model(root / f"{preset}-weights", preset=preset),
            make_model(root / f"{preset}-config", preset=preset, weights=False),
        )
        for preset in FAMILIES
    }


def _layout(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}


def _run(runner: ModelRunner) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Greedy tokens of three sequences (chunked prefills, then decodes) and every logits row sampled."""
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 7, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 30, runner.vocab_size))
    driver.step({0: 7, 1: 20})
    driver.add(2, _random_prompt(rng, 12, runner.vocab_size))
    driver.step({0: 1, 1: 10, 2: 12})
    for _ in range(5):
        driver.step({0: 1, 1: 1, 2: 1})
    return driver.tokens, [row for _, _, row in driver.records]


@pytest.mark.parametrize("preset", FAMILIES)
def test_dummy_weights_take_the_checkpoints_shapes_and_serve_finite_deterministic_tokens(
    preset: str, model_dirs: dict[str, tuple[Path, Path]]
) -> None:
    weights_dir, config_dir = model_dirs[preset]
    assert not list(config_dir.glob("*.safetensors"))  # nothing to read: the weights are drawn
    loaded = make_runner(weights_dir)
    dummy = make_runner(config_dir, load_format="dummy")
    assert _layout(dummy.model) == _layout(loaded.model)
    assert (dummy.vocab_size, dummy.max_model_len) == (loaded.vocab_size, loaded.max_model_len)
    tied = load_model_config(config_dir).tie_word_embeddings  # the LM head is the embedding, or its own
    assert (dummy.model.lm_head.weight is dummy.model.embed_tokens.weight) == tied
    assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    for module in dummy.model.modules():  # every norm starts as the identity: 1, or 0 for Gemma's 1 + w
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == (0.0 if module.unit_offset else 1.0))
    matrix = dummy.model.layers[0].self_attn.qkv_proj.weight
    assert abs(matrix.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD and abs(matrix.mean().item()) < 1e-3

    tokens, rows = _run(dummy)
    logits = torch.stack(rows)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.05  # not flat: the tokens are chosen, not tied
    assert (logits - logits[0]).abs().amax() > 0.05  # rows differ by position and sequence
    assert all(0 <= t < dummy.vocab_size for seq in tokens.values() for t in seq)
    again_tokens, again_rows = _run(make_runner(config_dir, load_format="dummy"))
    assert again_tokens == tokens and torch.equal(torch.stack(again_rows), logits)  # the same seed
    other = make_runner(config_dir, load_format="dummy", seed=1)
    assert not torch.equal(other.model.layers[0].self_attn.qkv_proj.weight, matrix)


def _on_fp8_grid(w: torch.Tensor) -> bool:
    """Whether each row of `w` is an e4m3 value times one per-row scale (what a dequantized FP8 weight is)."""
    q, scale = quantize_rows(w)
    return torch.allclose(q.float() * scale[:, None], w.float(), rtol=1e-6, atol=0)


def _fp8_layout(model: torch.nn.Module) -> dict[str, bool]:
    """Each Fp8Linear, and whether it is quantized."""
    return {n: m.quant is not None for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_quantization_fp8_quantizes_the_random_weights_as_a_checkpoints(
    preset: str, model_dirs: dict[str, tuple[Path, Path]]
) -> None:
    """--quantization fp8: FP8 projections where a loaded checkpoint has them, their weights rounded to the
    per-row FP8 grid at load (on the CPU, dequantized into the model dtype, as a checkpoint's)."""
    weights_dir, config_dir = model_dirs[preset]
    loaded = make_runner(weights_dir, quantization="fp8")
    dummy = make_runner(config_dir, load_format="dummy", quantization="fp8")
    layout = _fp8_layout(dummy.model)
    assert layout and all(layout.values()) and layout == _fp8_layout(loaded.model)
    assert _layout(dummy.model) == _layout(loaded.model)
    for module in dummy.model.modules():
        if isinstance(module, Fp8Linear):
            assert _on_fp8_grid(module.weight)
    plain = make_runner(config_dir, load_format="dummy")
    assert not _on_fp8_grid(plain.model.layers[0].self_attn.o_proj.weight)  # the check tells them apart
    _, rows = _run(dummy)
    assert torch.isfinite(torch.stack(rows)).all()


@pytest.mark.parametrize(
    "qconfig",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]},
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}}},
         "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]},
    ],
    ids=["fp8-blocks", "compressed-tensors"],
)  # fmt: skip
def test_a_quantized_config_gets_random_fp8_weights_with_their_scales(
    qconfig: dict, model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """A config.json whose quantization_config says the weights are FP8: each projection it quantizes is
    drawn, quantized per row and handed its scales as a checkpoint's (its ignore list stays unquantized)."""
    model_dir = tmp_path / "fp8"
    shutil.copytree(model_dirs["tiny"][1], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"quantization_config": qconfig}))
    runner = make_runner(model_dir, load_format="dummy")
    layout = _fp8_layout(runner.model)
    ignored = {n for n, quantized in layout.items() if not quantized}
    assert ignored == ({"layers.1.mlp.down_proj"} if "ignore" in qconfig else set())
    for name, module in runner.model.named_modules():
        if isinstance(module, Fp8Linear) and name not in ignored:
            assert _on_fp8_grid(module.weight) and module.weight.dtype == torch.float32
    tokens, rows = _run(runner)
    assert torch.isfinite(torch.stack(rows)).all()


def test_tensor_parallel_ranks_draw_their_shards_and_agree_on_whole_parameters(
    model_dirs: dict[str, tuple[Path, Path]],
) -> None:
    """Two ranks' models (built without a process group: drawing needs none): each holds its shard's
    shapes; what every rank holds whole (norms, the MoE router) is equal on both; padding is zero."""
    config = load_model_config(model_dirs["qwen3-moe-tiny"][1])
    config = dataclasses.replace(config, vocab_size=config.vocab_size - 3)  # an uneven split
    whole = build_model(config, 64, _backend(), torch.float32, torch.device("cpu"))
    ranks = []
    for rank in range(2):
        parallel = ParallelContext(rank, 2)
        model = build_model(config, 64, _backend(), torch.float32, torch.device("cpu"), parallel)
        init_dummy_weights(model, config, seed=3, parallel=parallel)
        ranks.append(dict(model.named_parameters()))
    for name, param in whole.named_parameters():
        first, second = ranks[0][name], ranks[1][name]
        assert first.shape == second.shape
        if first.shape == param.shape:  # held whole: the same values on every rank
            assert torch.equal(first, second), name
        else:
            assert sum(first.shape) < sum(param.shape), name
    rows = ranks[1]["embed_tokens.weight"].shape[0]
    real = config.vocab_size - rows
    assert torch.all(ranks[1]["embed_tokens.weight"][real:] == 0)
    assert torch.all(ranks[1]["lm_head.weight"][real:] == 0)
    assert torch.all(ranks[1]["embed_tokens.weight"][:real].abs().sum(-1) > 0)


def _backend():  # the reference attention: the models above only hold weights
    from pagedserve.worker.attention import get_attention_backend

    return get_attention_backend("torch")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--load-format", "safetensors"], {}, "argument --load-format: invalid choice: 'safetensors'"),
        ([], {"PAGEDSERVE_LOAD_FORMAT": "pt"}, "bad setting: load_format must be one of auto, dummy"),
    ],
)
def test_a_bad_load_format_fails_at_parse_time_with_one_line(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as done:
        parse_config(WorkerConfig, ["--model", str(tiny_model_dir), *argv])
    text = capsys.readouterr().err.strip() or str(done.value.code)
    assert message in text.splitlines()[-1]
    for name in env:
        monkeypatch.delenv(name)
    assert parse_config(WorkerConfig, ["--model", str(tiny_model_dir), "--load-format", "dummy"]).load_format


@pytest.mark.e2e
def test_the_procfile_serves_a_directory_without_weights(
    model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """scripts/start's way (honcho on the Procfile, PAGEDSERVE_* settings): PAGEDSERVE_LOAD_FORMAT=dummy
    serves a config-and-tokenizer directory (gemma2-tiny's), and the memory line counts the drawn weights."""
    stack = Honcho(
        model_dirs["gemma2-tiny"][1], tmp_path / "honcho.log", num_kv_blocks=24, load_format="dummy"
    )
    try:
        stack.wait_healthy()
        status, body = stack.post({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        logs = stack.logs()
        assert '"load_format": "dummy"' in logs and '"weights_gib"' in logs and '"kv_blocks": 24' in logs
    finally:
        stack.stop()


@pytest.mark.e2e
@pytest.mark.parametrize(("quantization", "tensor_parallel_size"), [("fp8", 1), ("", 2)])
def test_bench_throughput_runs_on_dummy_weights(
    quantization: str, tensor_parallel_size: int, model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The lead's GPU commands in small, from a directory without weights: --quantization fp8 on random
    weights of the MoE, and two tensor-parallel ranks each drawing its shard; every request gets its tokens.
    (--compare's sides take load_format too.)"""
    out = tmp_path / "bench.json"
    model = str(model_dirs["qwen3-moe-tiny"][1])
    argv = ["--model", model, "--load-format", "dummy", "--quantization", quantization, "--device", "cpu"]
    argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += ["--num-requests", "6", "--min-prompt-len", "8", "--max-prompt-len", "32"]
    argv += ["--min-output-len", "8", "--max-output-len", "8", "--num-warmup", "2"]
    argv += ["--num-kv-blocks", "32", "--max-model-len", "128", "--runs", "paged", "--json-out", str(out)]
    bench_main(argv)
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["load_format"], run["quantization"], run["completed"]) == ("dummy", quantization, 6)
    assert run["tensor_parallel_size"] == tensor_parallel_size
    assert run["output_tokens"] == run["expected_output_tokens"] == 48
    assert parse_side("load_format=dummy,quantization=fp8") == {"load_format": "dummy", "quantization": "fp8"}
    with pytest.raises(SystemExit):  # the peers load weights with transformers
        parse_args(["--load-format", "dummy", "--peers", "hf-static"])


def test_a_hub_model_with_dummy_weights_fetches_no_safetensors(
    model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo id with --load-format dummy: the snapshot is fetched without its weights (offline here: a cache
    that holds config and tokenizer only serves), and a dummy worker loads from it."""
    import huggingface_hub

    home = tmp_path / "hf"
    add_to_hub_cache(home, "org/tiny-dummy", model_dirs["tiny"][1])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    asked: list[list[str]] = []
    download = huggingface_hub.snapshot_download

    def recording(*args: object, **kw: object) -> str:
        asked.append(list(kw["allow_patterns"]))  # type: ignore[call-overload]
        return download(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    cfg = resolve_config(WorkerConfig(model="org/tiny-dummy", load_format="dummy", device="cpu"))
    assert Path(cfg.model).is_dir() and cfg.served_model_name == "org/tiny-dummy"
    _, env = cli_parse(["org/tiny-dummy", "--load-format", "dummy"])
    assert env["PAGEDSERVE_MODEL"] == str(Path(cfg.model).absolute())
    assert len(asked) == 2 and all("*.safetensors" not in patterns for patterns in asked)
    assert "*.json" in asked[0]
    resolve_model("org/tiny-dummy", weights=True)  # a real load asks for the weights
    assert "*.safetensors" in asked[-1]
    runner = ModelRunner(replace(cfg, dtype="float32", num_kv_blocks=16))
    assert runner.vocab_size == load_model_config(model_dirs["tiny"][0]).vocab_size


def test_a_draft_model_is_drawn_too(model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """With --load-format dummy a --speculative-config draft has random weights as the target does (vLLM
    loads both with one load format): a draft directory without weights serves, and its draws are its own."""
    draft_dir = make_model(tmp_path / "draft", preset="tiny-draft", weights=False)
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2})
    runner = make_runner(model_dirs["tiny"][1], load_format="dummy", speculative_config=spec)
    draft = runner.spec.proposer.model  # type: ignore[union-attr]
    assert _layout(draft) == _layout(build_model(load_model_config(draft_dir), 64, _backend(), torch.float32,
                                                 torch.device("cpu")))  # fmt: skip
    weight = draft.layers[0].self_attn.qkv_proj.weight
    assert abs(weight.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD
    assert all(torch.isfinite(p).all() for p in draft.parameters())
