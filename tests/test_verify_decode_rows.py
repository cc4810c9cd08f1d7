"""Verification as a decode batch (worker/spec/decode_rows.py): a speculating step's 1 + d tokens per
sequence as one decode row each give the attention of one causal chunk per sequence, in every backend, with
sliding windows over tables with holes and with FP8 caches; through the real scheduler and runner, greedy
outputs with speculation (n-gram and draft-model proposers, the Triton kernels, a sliding-window model, an
FP8 cache) stay those without, and the verification steps did run as decode rows."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pagedserve.worker.model_runner as model_runner
from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.attention import AttentionMetadata, get_attention_backend
from pagedserve.worker.inputs import HostInputs, build_inputs
from pagedserve.worker.kv_window import freeing_window
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.spec.decode_rows import as_decode_rows, verification_inputs
from pagedserve.worker.spec.device_drafts import DeviceDrafts
from tests.kernels.conftest import HAS_CUDA, INTERPRET
from tests.test_engine_correctness import _run_engine
from tests.test_sliding_window_engine import BLOCK_SIZE, MAX_TOKENS, WINDOW, mistral  # noqa: F401
from tests.test_speculative_engine import NGRAM, make_runner, prompts, run_engine

BACKENDS = ["torch"] + (["triton"] if INTERPRET or HAS_CUDA else [])
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _batch(rng: random.Random, block_size: int, window: int) -> tuple[HostInputs, int]:
    """A step of 5 sequences, each computing 1 + d tokens (d in 0..4) after a context of 0..40 tokens; with
    a window, the blocks wholly before every row's window are holes (block 0, as the scheduler sends them).
    Returns the inputs and the pool's size."""
    starts = [rng.randrange(0, 41) for _ in range(5)]
    num_tokens = [1 + rng.randrange(0, 5) for _ in range(5)]
    max_blocks = -(-(max(starts) + 5) // block_size)
    num_pool = 1 + 5 * max_blocks
    ids = list(range(1, num_pool))
    rng.shuffle(ids)
    tables = np.zeros((5, max_blocks), dtype=np.int32)
    for b, start in enumerate(starts):
        row = ids[b * max_blocks : (b + 1) * max_blocks]
        if window:  # what the first row's window leaves out: no row of the sequence reads it
            holes = max(0, start - window + 1) // block_size
            row[:holes] = [0] * holes
        tables[b] = row
    inputs = build_inputs(
        SimpleNamespace(tables=tables),  # type: ignore[arg-type]
        np.arange(5),
        np.array(starts, dtype=np.int64),
        np.array(num_tokens, dtype=np.int64),
        np.array([rng.randrange(100) for _ in range(sum(num_tokens))], dtype=np.int64),
        block_size,
    )
    return inputs, num_pool


def _meta(inputs: HostInputs) -> AttentionMetadata:
    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)

    return AttentionMetadata(
        slot_mapping=put(inputs.slot_mapping), block_tables=put(inputs.block_tables),
        seq_lens=put(inputs.seq_lens), query_start_loc=put(inputs.query_start_loc),
        max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len,
        num_decode_seqs=inputs.num_decode_seqs,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [0, 6], ids=["global", "window-6"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
def test_decode_rows_attend_as_the_chunks_do(backend: str, window: int, fp8: bool) -> None:
    """Each backend's forward (the KV write, then attention) over the decode rows gives the mixed layout's
    outputs and leaves the same cache, window and holes and FP8 scales included."""
    rng = random.Random(window * 2 + fp8)
    block_size, hq, hkv, d = 4, 4, 2, 32
    attn = get_attention_backend(backend)
    for _ in range(3):
        mixed, num_pool = _batch(rng, block_size, window)
        rows = as_decode_rows(mixed)
        t = len(mixed.token_ids)
        assert rows.decode_only and rows.num_decode_seqs == t == len(rows.seq_lens)
        assert np.array_equal(rows.slot_mapping, mixed.slot_mapping)
        torch.manual_seed(rng.randrange(1 << 30))
        q, k, v = (torch.randn(t, h, d, device=DEVICE) for h in (hq, hkv, hkv))
        cache_dtype = torch.float8_e4m3fn if fp8 else torch.float32
        scales = (0.5, 0.25) if fp8 else (1.0, 1.0)
        history = torch.randn(2, num_pool, block_size, hkv, d, device=DEVICE)  # the contexts' own KV
        outs, caches = [], []
        for inputs in (mixed, rows):
            kc, vc = ((history[i] / scales[i]).to(cache_dtype) for i in range(2))
            out = attn.forward(
                q, k, v, kc, vc, _meta(inputs), d**-0.5, *scales, sliding_window=window, softcap=0.0
            )
            outs.append(out.float())
            caches.append((kc.float(), vc.float()))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        for a, b in zip(caches[0], caches[1], strict=True):
            assert torch.equal(a, b)


def test_only_all_decode_steps_with_drafts_and_no_prompt_scores_expand() -> None:
    rng = random.Random(3)
    inputs, _ = _batch(rng, 4, 0)
    decode = list(np.diff(inputs.query_start_loc))
    ones = [1] * len(decode)
    assert verification_inputs(inputs, ones, decode, False, None).num_decode_seqs == len(inputs.token_ids)
    assert verification_inputs(inputs, ones, decode, True, None) is inputs  # prompt logprobs: mixed
    assert verification_inputs(inputs, [2] + ones[1:], decode, False, None) is inputs  # a prefill chunk
    small = SimpleNamespace(padded_size=lambda n: n if n <= 4 else None)  # graphs up to 4 rows
    assert verification_inputs(inputs, ones, decode, False, small) is inputs  # type: ignore[arg-type]


@pytest.fixture
def decode_row_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(sequences, rows) of every verification the runner ran as decode rows."""
    seen: list[tuple[int, int]] = []
    real = model_runner.verification_inputs

    def spy(inputs, *args):
        out = real(inputs, *args)
        if out is not inputs:
            seen.append((len(inputs.seq_lens), len(out.seq_lens)))
        return out

    monkeypatch.setattr(model_runner, "verification_inputs", spy)
    return seen


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    runner = make_runner(tiny_model_dir, 400)
    return run_engine(runner, prompts(runner.vocab_size), GREEDY, pipelined=False)[0]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_ngram_verification_runs_as_decode_rows_with_the_same_outputs(
    tiny_model_dir, plain, decode_row_steps, pipelined
):
    runner = make_runner(tiny_model_dir, 40, NGRAM)
    ours, scheduler, _ = run_engine(
        runner, prompts(runner.vocab_size), GREEDY, pipelined, preemption_mode="swap"
    )
    assert ours == plain
    assert scheduler.metrics.spec_accepted_tokens_total > 0 and scheduler.metrics.swap_outs_total > 0
    assert decode_row_steps and all(rows > seqs for seqs, rows in decode_row_steps)


def test_the_mixed_layout_still_verifies_when_rows_are_not_expanded(tiny_model_dir, plain, monkeypatch):
    """The path a step takes past the graphs' sizes (or with prompt logprobs): one chunk per sequence."""
    monkeypatch.setattr(model_runner, "verification_inputs", lambda inputs, *args: inputs)
    runner = make_runner(tiny_model_dir, 400, NGRAM)
    ours, scheduler, _ = run_engine(runner, prompts(runner.vocab_size), GREEDY, True)
    assert ours == plain and scheduler.metrics.spec_accepted_tokens_total > 0


def _no_host_drafts(runner: ModelRunner) -> ModelRunner:
    """The runner's draft model may not hand its drafts to the host before the step (worker/spec/
    device_drafts.py): `propose`, which waits for them, fails."""

    def propose(rows):
        raise AssertionError("the drafts went through the host")

    runner.spec.proposer.propose = propose
    return runner


def test_a_draft_model_verified_as_decode_rows_keeps_the_outputs(tiny_model_dir, plain, decode_row_steps):
    """The target as its own draft: every draft accepted, k + 1 rows per sequence, n > 1 forks beside; the
    drafts reach the target on the device."""
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4})
    runner = _no_host_drafts(make_runner(tiny_model_dir, 400, spec))
    ps = prompts(runner.vocab_size)
    ours, scheduler, _ = run_engine(runner, ps, GREEDY, pipelined=False)
    assert ours == plain
    m = scheduler.metrics
    assert m.spec_accepted_tokens_total == m.spec_draft_tokens_total > 0
    assert any(rows >= 5 * seqs for seqs, rows in decode_row_steps)  # all four drafts of every row
    two = SamplingParams(n=2, max_tokens=12, temperature=0.0)
    forked, _, _ = run_engine(_no_host_drafts(make_runner(tiny_model_dir, 400, spec)), ps[:4], two, True)
    for (i, j), tokens in forked.items():
        assert tokens == plain[(i, 0)][:12], (i, j)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
def test_triton_decode_rows_verify_as_the_torch_reference(tiny_model_dir, plain, decode_row_steps):
    triton = ModelRunner(
        WorkerConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=400,
            speculative_config=NGRAM, attention_backend="triton",
        ),
        attention_backend="triton",
    )  # fmt: skip
    ps = prompts(triton.vocab_size)
    picked = [len(ps) - 4, len(ps) - 3]  # the repetitive prompts: drafts found and accepted
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ours, scheduler, _ = run_engine(triton, [ps[i] for i in picked], params, pipelined=False)
    for n, i in enumerate(picked):
        assert ours[(n, 0)] == plain[(i, 0)][:12]
    assert scheduler.metrics.spec_accepted_tokens_total > 0 and decode_row_steps


def test_fp8_cache_outputs_with_speculation_are_those_without(tiny_model_dir, decode_row_steps):
    """FP8 KV: the verification rows read the quantized drafts' keys as the decode steps would."""

    def runner(spec: str) -> ModelRunner:
        return ModelRunner(
            WorkerConfig(
                model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=400,
                kv_cache_dtype="fp8", speculative_config=spec,
            )
        )  # fmt: skip

    ps = prompts(make_runner(tiny_model_dir, 8).vocab_size)[-4:-2]  # the repetitive ones: drafts accepted
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected, _, _ = run_engine(runner(""), ps, params, pipelined=False)
    ours, scheduler, _ = run_engine(runner(NGRAM), ps, params, pipelined=False)
    assert ours == expected
    assert scheduler.metrics.spec_accepted_tokens_total > 0 and decode_row_steps


def test_sliding_window_verification_far_past_the_window_matches_transformers(
    mistral,  # noqa: F811 (the fixture, imported)
    decode_row_steps,
):
    """Every layer slides over 8 tokens, the blocks behind the window are holes (a pool of 64 slots for
    sequences of 59 to 100 tokens): decode rows of draft j read only its own window, and the outputs are
    transformers' own."""
    path, ps, expected = mistral
    config = WorkerConfig(
        model=str(path), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=16,
        swap_space=0.01, speculative_config=NGRAM,
    )  # fmt: skip
    runner = ModelRunner(config)
    window = freeing_window(runner.model_config, runner.spec)
    assert window == WINDOW  # n-gram drafts read no KV: the target's blocks still leave the window
    ours, scheduler = _run_engine(
        runner, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), max_num_seqs=6,
        max_num_batched_tokens=16, num_cpu_blocks=runner.num_cpu_blocks, sliding_window=window,
        preemption_mode="recompute", num_speculative_tokens=runner.num_speculative_tokens,
    )  # fmt: skip
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i}"
    assert scheduler.metrics.spec_draft_tokens_total > 0 and decode_row_steps


def test_device_drafts_feed_their_ids_after_each_first_token() -> None:
    tokens = torch.tensor([[5, 6, 7], [0, 0, 0], [8, 9, 0]])
    drafts = DeviceDrafts([3, 0, 2], tokens).start_copy()
    flat, ids = drafts.feed([2, 0], np.array([11, 1]))
    assert flat.tolist() == [11, 12, 1, 2, 3] and ids.tolist() == [8, 9, 5, 6, 7]
    assert drafts.host() == [[5, 6, 7], [], [8, 9]]


def test_the_step_trace_shows_proposing_apart_and_counts_the_drafts(tiny_model_dir, tmp_path):
    """The runner's launch marks come in the trace's phase order, proposing in a phase of its own, and a
    drafting step's line counts the drafts it verified."""
    from pagedserve.worker.step_trace import PHASES, StepTrace, read_trace

    runner = make_runner(tiny_model_dir, 400, NGRAM)
    runner.trace_launches = True
    trace = StepTrace(tmp_path / "steps.jsonl")
    launch, finish = runner.launch_forward, runner.finish
    opened: dict[int, object] = {}

    def traced_launch(plan):
        out = launch(plan)
        opened[plan.step_id] = plan
        return out

    def traced_finish():
        out = finish()
        plan = opened.pop(out.step_id)
        marks = dict(runner.launch_marks)
        trace.launched(plan, marks["start"], marks["start"], marks)
        trace.answered(out, marks["start"], marks["start"], marks["start"])
        return out

    runner.launch_forward, runner.finish = traced_launch, traced_finish
    ps = prompts(runner.vocab_size)[-4:-2]
    run_engine(runner, ps, SamplingParams(max_tokens=12, temperature=0.0), pipelined=False)
    trace.close()
    lines = read_trace(tmp_path / "steps.jsonl")
    drafting = [line for line in lines if line.get("drafts")]
    assert drafting and all(line["decode"] for line in drafting)
    for line in lines:
        assert list(line["phases"]) == [p for p in PHASES if p in line["phases"]]
        assert "propose" in line["phases"] and "inputs" in line["phases"]
