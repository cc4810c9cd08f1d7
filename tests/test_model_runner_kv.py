"""KV memory management in the ModelRunner, driven by hand-built StepPlans on the tiny checkpoint:
copy-on-write block copies, swapping out and in, prefix-cache hits and forks."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import Fork, NewSequence, SamplingParams, StepOutput, StepPlan
from pagedserve.kernels import reference
from pagedserve.kernels.reference import byte_view
from pagedserve.worker.kv_cache import kv_block_bytes
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.plan_check import PlanError

BLOCK_SIZE = 16


def make_runner(
    model_dir: Path,
    num_kv_blocks: int = 16,
    num_cpu_blocks: int = 8,
    kv_cache_dtype: str = "auto",
    device: str = "cpu",
) -> ModelRunner:
    kv_dtype = torch.float32 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    block_gib = kv_block_bytes(load_model_config(str(model_dir)), BLOCK_SIZE, kv_dtype) / (1 << 30)
    runner = ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            device=device,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            swap_space=num_cpu_blocks * block_gib,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=True,
        )
    )
    assert runner.num_cpu_blocks == num_cpu_blocks
    return runner


class Steps:
    """Sends plans to one runner with increasing step ids, and keeps every logits row it samples from
    (fork children share their parent's row, so rows line up with the scheduled samplers only)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.rows: dict[int, list[torch.Tensor]] = {}  # seq_id -> logits row of each of its sampled tokens
        self._last: list[torch.Tensor] = []
        compute_logits = runner.model.compute_logits

        def recording(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            self._last = list(logits.clone())
            return logits

        runner.model.compute_logits = recording

    def run(self, schedule: dict[int, int] | None = None, **fields: Any) -> StepOutput:
        schedule = schedule or {}
        new_seqs = fields.pop("new_seqs", [])
        if "sampling_seq_ids" not in fields:
            fields["sampling_seq_ids"] = self._reaching_end(schedule, new_seqs, fields)
        plan = StepPlan(
            self.step_id,
            fields.pop("freed_seq_ids", []),
            new_seqs,
            fields.pop("new_block_ids", []),
            list(schedule),
            list(schedule.values()),
            fields.pop("sampling_seq_ids"),
            **fields,
        )
        self.step_id += 1
        self._last = []
        out = self.runner.execute(plan)
        for seq_id, row in zip(out.seq_ids, self._last, strict=False):
            self.rows.setdefault(seq_id, []).append(row)
        return out

    def _reaching_end(self, schedule: dict[int, int], new_seqs: list[NewSequence], fields: dict) -> list[int]:
        """The scheduled sequences whose tokens the step computes up to the last known one: those sample
        (the scheduler's rule, played here from the runner's state and the plan's changes)."""
        known = {s: len(seq.token_ids) + seq.pending for s, seq in self.runner.sequences.seqs.items()}
        computed = {s: seq.num_computed_tokens for s, seq in self.runner.sequences.seqs.items()}
        for parent, child in fields.get("clones", []):
            known[child], computed[child] = known[parent], computed[parent]
        for seq_id, _ in fields.get("appended_tokens", []):
            known[seq_id] += 1
        for new in new_seqs:
            known[new.seq_id], computed[new.seq_id] = len(new.token_ids), new.num_computed_tokens
        return [s for s, n in schedule.items() if s in known and computed[s] + n == known[s]]

    def decode(self, seq_ids: list[int], steps: int) -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {s: [] for s in seq_ids}
        for _ in range(steps):
            out = self.run(dict.fromkeys(seq_ids, 1))
            assert out.seq_ids == seq_ids
            for seq_id, token in zip(out.seq_ids, out.token_ids, strict=True):
                tokens[seq_id].append(token)
        return tokens


def new_seq(
    seq_id: int,
    token_ids: list[int],
    block_table: list[int],
    num_computed_tokens: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
) -> NewSequence:
    return NewSequence(
        seq_id, token_ids, block_table, num_computed_tokens, SamplingParams(temperature=temperature), seed
    )


def random_prompt(seed: int, length: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


# The block copies and swaps on the CPU, and on CUDA (the Triton copy kernel over the pool's bytes, pinned
# swap transfers) where there is a GPU.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_block_copies_copy_exactly_the_listed_blocks_in_every_layer(
    tiny_model_dir: Path, kv_cache_dtype: str, device: str
) -> None:
    runner = make_runner(tiny_model_dir, num_kv_blocks=12, kv_cache_dtype=kv_cache_dtype, device=device)
    pool = runner.kv.device_pool  # [L, 2, num_blocks, Hkv, block_size, D]
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)))
    pool = byte_view(pool)
    before = pool.clone()
    copies = [(3, 7), (3, 9), (0, 11), (5, 2)]

    Steps(runner).run(block_copies=copies)

    expected = before.clone()
    for src, dst in copies:
        expected[:, :, dst] = before[:, :, src]
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(pool, expected)
    for layer, (k_cache, v_cache) in enumerate(runner.kv.layers):  # what the model reads sees the copies
        # The layers' views index [num_blocks, block_size, Hkv, D]; the pool holds blocks head-major.
        assert torch.equal(byte_view(k_cache)[9], before[layer, 0, 3].transpose(0, 1))
        assert torch.equal(byte_view(v_cache)[2], before[layer, 1, 5].transpose(0, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_swaps_copy_exactly_the_listed_blocks_between_the_pools(
    tiny_model_dir: Path, kv_cache_dtype: str, device: str
) -> None:
    runner = make_runner(
        tiny_model_dir, num_kv_blocks=12, num_cpu_blocks=10, kv_cache_dtype=kv_cache_dtype, device=device
    )
    pool, cpu = runner.kv.device_pool, runner.kv.cpu_pool  # [L, 2, n, ...] and block-major [n, L, 2, ...]
    gen = torch.Generator().manual_seed(1)
    pool.copy_(torch.randn(pool.shape, generator=gen))
    cpu.copy_(torch.randn(cpu.shape, generator=gen))
    pool, cpu = byte_view(pool), byte_view(cpu)
    before, cpu_before = pool.clone(), cpu.clone()
    # CPU blocks 2, 3 are one run, 7 and 8 single ones (8 follows 7 but not in the list's order).
    swap_out = [(3, 7), (0, 2), (5, 3), (11, 0), (1, 8)]

    Steps(runner).run(swap_out=swap_out)
    if device == "cuda":
        torch.cuda.synchronize()  # swap-outs into pinned memory are asynchronous

    assert torch.equal(pool, before)  # the device pool is only read
    expected_cpu = cpu_before.clone()
    for device_block, cpu_block in swap_out:
        expected_cpu[cpu_block] = before[:, :, device_block]
    assert torch.equal(cpu, expected_cpu)

    swap_in = [(8, 4), (2, 0), (3, 1), (9, 10), (7, 6)]  # CPU 2, 3 again one run; 9 never swapped: stale data
    Steps(runner).run(swap_in=swap_in)
    if device == "cuda":
        torch.cuda.synchronize()

    expected = before.clone()
    for cpu_block, device_block in swap_in:
        expected[:, :, device_block] = expected_cpu[cpu_block]
    assert torch.equal(pool, expected)
    assert torch.equal(pool[:, :, 4], before[:, :, 1]) and torch.equal(pool[:, :, 0], before[:, :, 0])


def test_swap_out_then_in_to_other_blocks_continues_exactly_as_without_swapping(tiny_model_dir: Path) -> None:
    prompts = {0: random_prompt(0, 37), 1: random_prompt(1, 40)}
    reference = Steps(make_runner(tiny_model_dir))
    expected: dict[int, list[int]] = {}
    for seq_id, table, decodes in ((0, [0, 1, 2], 8), (1, [3, 4, 5], 4)):
        out = reference.run(
            {seq_id: len(prompts[seq_id])}, new_seqs=[new_seq(seq_id, prompts[seq_id], table)]
        )
        expected[seq_id] = out.token_ids + reference.decode([seq_id], decodes)[seq_id]

    steps = Steps(make_runner(tiny_model_dir))
    got = {0: steps.run({0: 37}, new_seqs=[new_seq(0, prompts[0], [0, 1, 2])]).token_ids}
    got[0] += steps.decode([0], 3)[0]
    # Sequence 0 goes out; sequence 1 takes its blocks in the same plan and overwrites them.
    out = steps.run({1: 40}, swap_out=[(0, 5), (1, 6), (2, 7)], new_seqs=[new_seq(1, prompts[1], [0, 1, 2])])
    got[1] = out.token_ids
    # Sequence 1 goes out and sequence 0 comes back in one plan, partly into the blocks 1 just left.
    got[0] += steps.run(
        {0: 1},
        swap_out=[(0, 0), (1, 1), (2, 2)],
        swap_in=[(5, 9), (6, 0), (7, 3)],
        new_block_tables=[(0, [9, 0, 3])],
    ).token_ids
    got[0] += steps.decode([0], 4)[0]
    steps.run(swap_in=[(0, 4), (1, 10), (2, 2)], new_block_tables=[(1, [4, 10, 2])])
    got[1] += steps.decode([1], 4)[1]

    assert got == expected
    for seq_id in (0, 1):  # same batches, same KV values: the very same logits
        assert len(steps.rows[seq_id]) == len(reference.rows[seq_id])
        for ours, theirs in zip(steps.rows[seq_id], reference.rows[seq_id], strict=True):
            assert torch.equal(ours, theirs)


def test_prefix_hit_computes_only_the_rest_and_matches_a_full_prefill(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    steps = Steps(runner)
    shared = random_prompt(2, 2 * BLOCK_SIZE)
    prompt = shared + random_prompt(3, 7)
    steps.run({0: 37}, new_seqs=[new_seq(0, shared + random_prompt(4, 5), [0, 1, 2])])
    cached = runner.kv.device_pool[:, :, [0, 1]].clone()

    # Sequence 1 finds the first two blocks of sequence 0 in the cache: only its last 7 tokens run.
    hit = steps.run({1: 7}, new_seqs=[new_seq(1, prompt, [0, 1, 3], num_computed_tokens=2 * BLOCK_SIZE)])
    full = steps.run({2: len(prompt)}, new_seqs=[new_seq(2, prompt, [4, 5, 6])])

    assert torch.equal(runner.kv.device_pool[:, :, [0, 1]], cached), "a cached block was written"
    torch.testing.assert_close(steps.rows[1][0], steps.rows[2][0], atol=1e-4, rtol=0)
    assert hit.token_ids == full.token_ids
    decoded = steps.decode([1, 2], 4)
    assert decoded[1] == decoded[2]


def test_fork_children_draw_and_decode_like_independent_sequences_with_their_seeds(
    tiny_model_dir: Path,
) -> None:
    prompt = random_prompt(5, 21)  # one full block and a partial one, which the children share
    seeds = [100, 101, 102, 103]

    independent = Steps(make_runner(tiny_model_dir))
    first = independent.run(
        dict.fromkeys(range(4), len(prompt)),
        new_seqs=[
            new_seq(i, prompt, [2 * i, 2 * i + 1], seed=s, temperature=1.0) for i, s in enumerate(seeds)
        ],
    )
    rest = independent.decode([0, 1, 2, 3], 8)
    expected = {i: [first.token_ids[i], *rest[i]] for i in range(4)}

    runner = make_runner(tiny_model_dir)
    steps = Steps(runner)
    forks = [Fork(0, child, seeds[child]) for child in (1, 2, 3)]
    out = steps.run(
        {0: len(prompt)}, new_seqs=[new_seq(0, prompt, [0, 1], seed=seeds[0], temperature=1.0)], forks=forks
    )
    assert out.seq_ids == [0, 1, 2, 3]
    assert out.token_ids == first.token_ids
    assert all(runner.sequences.block_table(child) == [0, 1] for child in (1, 2, 3))
    # Copy-on-write before the children write their next token into the shared partial block 1.
    second = steps.run(
        {0: 1, 1: 1, 2: 1, 3: 1},
        block_copies=[(1, 5), (1, 6), (1, 7)],
        new_block_tables=[(1, [0, 5]), (2, [0, 6]), (3, [0, 7])],
    )
    decoded = steps.decode([0, 1, 2, 3], 7)
    got = {i: [out.token_ids[i], second.token_ids[i], *decoded[i]] for i in range(4)}

    assert got == expected
    assert len({tuple(tokens) for tokens in got.values()}) == 4, "the seeds should make the streams differ"


def test_plans_that_misuse_kv_memory_raise(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, num_kv_blocks=8, num_cpu_blocks=4)
    steps = Steps(runner)
    steps.run({0: 20}, new_seqs=[new_seq(0, random_prompt(6, 20), [0, 1])])
    bad: list[tuple[str, dict[str, Any]]] = [
        ("outside the pools", {"swap_out": [(0, 4)]}),
        ("outside the pools", {"swap_in": [(4, 0)]}),
        ("outside the pools", {"swap_in": [(0, 8)]}),
        ("twice", {"swap_out": [(0, 1), (1, 1)]}),
        ("outside the pools", {"block_copies": [(0, 8)]}),
        ("twice", {"block_copies": [(0, 2), (1, 2)]}),
        ("reads", {"block_copies": [(0, 2), (2, 3)]}),
        ("unknown", {"new_block_tables": [(9, [0])]}),
        ("outside the KV pool", {"new_block_tables": [(0, [0, 8])]}),
        ("does not sample", {"forks": [Fork(5, 6, 0)]}),
        ("already exists", {"schedule": {0: 1}, "forks": [Fork(0, 0, 0)]}),
        ("appears twice", {"schedule": {0: 1}, "forks": [Fork(0, 6, 0), Fork(0, 6, 1)]}),
        ("computed", {"new_seqs": [new_seq(7, [1] * 40, [2, 3], num_computed_tokens=33)]}),
    ]
    for match, fields in bad:
        with pytest.raises(PlanError, match=match):
            steps.run(fields.pop("schedule", None), **fields)
    # A partly prefilled sequence does not sample, so it cannot fork.
    with pytest.raises(PlanError, match="does not sample"):
        steps.run({8: 10}, new_seqs=[new_seq(8, [1] * 20, [4, 5])], forks=[Fork(8, 9, 0)])


def test_swap_pool_size_follows_swap_space(tiny_model_dir: Path) -> None:
    assert make_runner(tiny_model_dir, num_cpu_blocks=0).num_cpu_blocks == 0
    runner = make_runner(tiny_model_dir, num_cpu_blocks=5)
    assert runner.kv.cpu_pool.shape[:3] == (5, runner.model_config.num_layers, 2)  # block-major
    with pytest.raises(PlanError, match="outside the pools"):
        make_runner(tiny_model_dir, num_cpu_blocks=0).execute(
            StepPlan(0, [], [], [], [], [], [], swap_out=[(0, 0)])
        )


def _fp8_runner(model_dir: Path, **fields: Any) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE, kv_cache_dtype="fp8",
            **fields,
        )
    )  # fmt: skip


def test_fp8_kv_cache_holds_four_times_the_blocks_of_float32_in_the_same_memory(tiny_model_dir: Path) -> None:
    config = load_model_config(str(tiny_model_dir))
    budget = 64 * kv_block_bytes(config, BLOCK_SIZE, torch.float32) / (1 << 30)
    fp8 = _fp8_runner(tiny_model_dir, kv_cache_memory_gib=budget, swap_space=budget)
    assert fp8.kv.device_pool.dtype == fp8.kv.cpu_pool.dtype == torch.float8_e4m3fn
    assert fp8.num_kv_blocks == 4 * 64 and fp8.num_cpu_blocks == 4 * 64
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        WorkerConfig(model=str(tiny_model_dir), kv_cache_dtype="int4")


def test_fp8_kv_cache_stores_scaled_keys_and_stays_close_to_full_precision(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A checkpoint with per-layer scales, as FP8-quantized checkpoints carry them.
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, scaled)
    tensors = load_file(scaled / "model.safetensors")
    num_layers = load_model_config(str(scaled)).num_layers
    # Exact in float32, so they read back as the very floats written.
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": 0.0625 * (i + 1) * (2 if kv == "v" else 1)
              for i in range(num_layers) for kv in "kv"}  # fmt: skip
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})

    full, fp8 = Steps(make_runner(tiny_model_dir)), Steps(_fp8_runner(scaled, num_kv_blocks=16))
    attention = fp8.runner.model.layers[1].self_attn
    assert (attention.k_scale, attention.v_scale) == (0.125, 0.25)
    prompt = random_prompt(5, 37)
    for steps in (full, fp8):
        steps.run({0: 37}, new_seqs=[new_seq(0, prompt, [3, 1, 4])])
    # Per-head scales are not per-tensor ones: refused, not read as their first element.
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.5, 0.25])
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="one per-tensor scale"):
        _fp8_runner(scaled, num_kv_blocks=16)
    # Layer 0's keys and values depend on the embeddings only: the FP8 pool holds exactly the full
    # precision ones divided by the layer's scales, rounded.
    for kv, scale in ((0, 0.0625), (1, 0.125)):
        stored = fp8.runner.kv.device_pool[0, kv, [3, 1, 4]]
        expected = reference.quantize(
            full.runner.kv.device_pool[0, kv, [3, 1, 4]], scale, torch.float8_e4m3fn
        )
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    # Through every layer, the prompt's logits stay within a few % of the full-precision cache's (e4m3 keeps
    # 3 mantissa bits); the random model's near-flat logits let the sampled tokens part after that, so the
    # decodes are only checked to run.
    ours, theirs = fp8.rows[0][0], full.rows[0][0]
    assert 0 < ((ours - theirs).norm() / theirs.norm()).item() < 0.1
    assert all(torch.isfinite(row).all() for row in fp8.rows[0] + [torch.tensor(fp8.decode([0], 4)[0])])
