"""Structured output through the real scheduler core and the real CPU model runner (worker/structured.py):
a tiny random model sampling at temperature 1, every output checked against its constraint by a reference
nobody here wrote (`jsonschema`, Python's `re`), under preemption (recompute and swap), forks (n > 1) and
the pipelined launch order."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.kernels.reference_bitmask import unpack_bitmask as _unpack
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.sequences import SeqState
from pagedserve.worker.structured import TokenBitmask, apply_token_bitmask
from tests.engine_loop import EngineRun, run_engine
from tests.structured_schemas import random_schema

MAX_TOKENS = 400  # a random model at temperature 1 finishes these documents far sooner


def _runner(model_dir, num_kv_blocks: int) -> ModelRunner:
    config = WorkerConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks,
        swap_space=0.05,
    )  # fmt: skip
    return ModelRunner(config)


def _run(runner: ModelRunner, prompts, params_list, pipelined: bool | str = False, **settings):
    """Runs one request per (prompt, params) in one scheduler, so that they share batches; returns
    {(request index, sample index): tokens} and the scheduler (`_run_all`)."""
    run = _run_all(runner, prompts, params_list, pipelined, **settings)
    return run.tokens, run.scheduler


def _run_all(
    runner: ModelRunner, prompts, params_list, pipelined: bool | str = False, **settings
) -> EngineRun:
    """Runs one request per (prompt, params) in one scheduler (tests/engine_loop.py). `pipelined`: step N+1
    launched whole before step N finishes (a tensor-parallel follower's order); "worker": in the worker
    loop's order (worker/server.py), step N+1's forward queued, step N finished, step N+1's sampler."""
    requests = list(zip(prompts, params_list, strict=True))
    run = run_engine(
        runner, requests, bool(pipelined), split_launch=pipelined == "worker", owner=b"t", max_steps=20000,
        num_cpu_blocks=runner.num_cpu_blocks, **settings,
    )  # fmt: skip
    return run


def _texts(runner: ModelRunner, outputs: dict, model_dir) -> dict[tuple[int, int], str]:
    """Each output's text, checked to end with EOS: the grammar completed, nothing was cut."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {}
    for key, tokens in outputs.items():
        assert tokens and tokens[-1] in runner.eos_token_ids, f"{key} did not finish ({len(tokens)} tokens)"
        texts[key] = tokenizer.decode(tokens[:-1], skip_special_tokens=False)
    return texts


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 4000) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def _schema_params(
    seed: int, num: int, n: int = 1, max_tokens: int = MAX_TOKENS
) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(num)]
    params = [
        SamplingParams(
            n=n, max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + i,
            # any_whitespace lets a random model emit hundreds of whitespace tokens: see the matcher test
            structured=StructuredOutput("json_schema", json.dumps(s), any_whitespace=False),
        )
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    return schemas, params


def _assert_valid(runner, outputs, schemas, model_dir, n: int = 1) -> None:
    assert len(outputs) == len(schemas) * n
    for (i, j), text in _texts(runner, outputs, model_dir).items():
        try:
            jsonschema.validate(json.loads(text), schemas[i])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"request {i} sample {j}: {text!r} against {schemas[i]}") from e


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_random_schemas_give_valid_json(tiny_model_dir, pipelined):
    runner = _runner(tiny_model_dir, 400)
    schemas, params = _schema_params(seed=1 + pipelined, num=16)
    outputs, _ = _run(runner, _prompts(16, 0), params, pipelined, max_num_seqs=16, max_num_batched_tokens=128)
    _assert_valid(runner, outputs, schemas, tiny_model_dir)


@pytest.mark.parametrize("order", [True, "worker"], ids=["launch", "worker-order"])  # (_run's `pipelined`)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_valid_under_preemption_and_forks(tiny_model_dir, mode, order):
    """A pool of 66 blocks of 4 tokens for 8 requests x 2 samples: sequences are preempted (recomputed or
    swapped) mid-document, their grammars' states rebuilt or kept, and each fork has its own matcher."""
    runner = _runner(tiny_model_dir, 66)
    schemas, params = _schema_params(seed=3, num=8, n=2, max_tokens=100)
    outputs, scheduler = _run(
        runner, _prompts(8, 1), params, pipelined=order, max_num_seqs=16, max_num_batched_tokens=64,
        preemption_mode=mode,
    )  # fmt: skip
    assert scheduler.metrics.preemptions_total >= 2
    if mode == "swap":
        assert scheduler.metrics.swap_outs_total >= 1
    _assert_valid(runner, outputs, schemas, tiny_model_dir, n=2)


def test_regex_choice_and_grammar(tiny_model_dir):
    runner = _runner(tiny_model_dir, 400)
    regex = r"(ab|cd)[0-9]{1,3}-[a-z]{2}"
    choices = ("yes", "no", 'say "hi"', "é中")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    constraints = [
        StructuredOutput("regex", regex),
        StructuredOutput("choice", choices=choices),
        StructuredOutput("grammar", grammar),
    ]
    params = [
        SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured=c)
        for i, c in enumerate(constraints)
    ]
    outputs, _ = _run(runner, _prompts(3, 2), params, max_num_seqs=16, max_num_batched_tokens=128)
    texts = _texts(runner, outputs, tiny_model_dir)
    for j in range(3):
        assert re.fullmatch(regex, texts[(0, j)])
        assert texts[(1, j)] in choices
        assert re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", texts[(2, j)])


def test_free_and_constrained_rows_share_a_batch(tiny_model_dir):
    """A constrained request beside unconstrained ones: theirs draw from the whole vocabulary (the same
    tokens as alone: a draw depends on its own logits row and seed only)."""
    runner = _runner(tiny_model_dir, 400)
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=6, structured=StructuredOutput("regex", "[a-f]{3,5}")
    )
    prompts = _prompts(2, 3)
    alone, _ = _run(runner, prompts[:1], [free], max_num_seqs=8, max_num_batched_tokens=64)
    runner.reset()  # a new scheduler's sequence ids start over
    both, _ = _run(runner, prompts, [free, constrained], max_num_seqs=8, max_num_batched_tokens=64)
    assert both[(0, 0)] == alone[(0, 0)]
    assert re.fullmatch("[a-f]{3,5}", _texts(runner, {(1, 0): both[(1, 0)]}, tiny_model_dir)[(1, 0)])


def test_a_grammar_that_fails_to_compile_ends_only_its_sequence(tiny_model_dir):
    """Past the api's check (a plan built in-process): the request whose grammar xgrammar refuses fails with
    an error (its sequence drew EOS, the only token its mask allowed, which is not sent); the worker and
    its batch-mate go on."""
    runner = _runner(tiny_model_dir, 400)
    bad = SamplingParams(max_tokens=50, temperature=1.0, structured=StructuredOutput("regex", "[a-"))
    good = SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    run = _run_all(runner, _prompts(2, 4), [bad, good], max_num_seqs=8, max_num_batched_tokens=64)
    outputs = run.tokens
    assert (0, 0) not in outputs
    (error,) = run.errors.values()  # (as the client gets it)
    assert error.request_id == "r0" and "constraint" in error.message
    assert len(outputs[(1, 0)]) == 8


def test_with_ignore_eos_the_completed_grammar_allows_only_eos(tiny_model_dir):
    """Exact output lengths for the benchmarks: past the grammar's end, EOS until max_tokens."""
    runner = _runner(tiny_model_dir, 400)
    structured = StructuredOutput("regex", "[a-f]{2}")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True, structured=structured)
    outputs, _ = _run(
        runner, _prompts(1, 5), [params], pipelined=True, max_num_seqs=8, max_num_batched_tokens=64
    )
    tokens = outputs[(0, 0)]
    end = next(i for i, t in enumerate(tokens) if t in runner.eos_token_ids)
    assert len(tokens) == 30 and all(t in runner.eos_token_ids for t in tokens[end:])
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(tokens[:end])
    assert re.fullmatch("[a-f]{2}", text)


def test_apply_token_bitmask_masks_exactly_the_forbidden_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    allowed = torch.rand(2, 70, generator=gen) < 0.3
    words = torch.zeros(2, 3, dtype=torch.int64)
    for t in range(70):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = TokenBitmask(torch.tensor([3, 1]), words.int())
    expected = logits.clone()
    expected[3] = expected[3].masked_fill(~allowed[0], float("-inf"))
    expected[1] = expected[1].masked_fill(~allowed[1], float("-inf"))
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), expected)
    assert torch.equal(_unpack(bitmask.bitmask, 70).bool(), allowed)  # the torch fallback's unpacking
    whole = TokenBitmask(torch.arange(2), bitmask.bitmask)  # every row constrained: masked in place
    assert torch.equal(
        apply_token_bitmask(logits[:2].clone(), whole)[1], expected[1].masked_fill(~allowed[1], float("-inf"))
    )


def test_any_whitespace_accepts_pretty_printed_json(tiny_model_dir):
    """With any_whitespace (vLLM's default, ours on request): whitespace between values, as
    json.dumps(indent=2) writes it; without it (our default), none. (Sampled outputs are tested without it: a
    random model draws whitespace for hundreds of tokens.)"""
    runner = _runner(tiny_model_dir, 64)
    schema = json.dumps(
        {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    )
    document = json.dumps({"a": [1, 2]}, indent=2)
    tokens = AutoTokenizer.from_pretrained(tiny_model_dir)(document, add_special_tokens=False)["input_ids"]
    for any_whitespace in (True, False):
        params = SamplingParams(
            structured=StructuredOutput("json_schema", schema, any_whitespace=any_whitespace)
        )
        seq = SeqState(list(range(3)) + tokens, 0, params, 0, -1, 0, prompt_len=3)
        bitmask = runner.structured.bitmask(0, [7], [seq], dict, torch.device("cpu"))
        state = runner.structured.matchers.pop(7)
        assert (state.matcher is not None) == any_whitespace  # a token outside the grammar ends the matcher
        if any_whitespace:
            eos = runner.eos_token_ids[0]
            assert state.matcher.is_completed()
            assert bitmask is not None and (bitmask.bitmask[0, eos // 32] >> (eos % 32)) & 1
