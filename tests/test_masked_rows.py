"""A request whose own token rules leave its row no token to draw fails alone (worker/masked_rows.py): its
allowed_token_ids against its JSON schema, or its allowed_token_ids against its bad_words, through the real
scheduler core and CPU model runner (tests/engine_loop.py); the flag comes back with the sampled tokens, and
the valid requests in the same batch complete as they do alone."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import ErrorKind, SamplingParams
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.worker.logits_processors import LogitsProcessors
from pagedserve.worker.masked_rows import masked_seq_ids
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.sampler import SamplingTensors, sample_tensors
from pagedserve.worker.spec.verify import SpecBatch
from tests.engine_loop import run_engine
from tests.test_logits_processors import Seq

LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _runner(model_dir) -> ModelRunner:
    config = WorkerConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=200
    )
    return ModelRunner(config)


def _letter_tokens(model_dir, count: int) -> list[int]:
    """Tokens that are letters only: no JSON text starts with one (an object starts with `{`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip().isalpha()]
    assert len(ids) >= count
    return ids[:count]


def _schema_params(**kw) -> SamplingParams:
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    return SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured=structured, **kw)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_allowed_tokens_that_exclude_the_schema_fail_that_request_alone(tiny_model_dir, pipelined):
    runner = _runner(tiny_model_dir)
    clash = _schema_params(allowed_token_ids=tuple(_letter_tokens(tiny_model_dir, 20)))
    valid = _schema_params()
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    run = run_engine(
        runner, list(zip(prompts, [clash, valid, plain], strict=True)), pipelined,
        **LIMITS,
    )  # fmt: skip
    (error,) = run.errors.values()
    assert run.errors.keys() == {0}
    assert error.kind == ErrorKind.INVALID_REQUEST and "allowed_token_ids" in error.message
    assert not any(out.token_ids for out in run.outputs[0])  # not one token of it went out
    # The batch-mates are what they are alone.
    alone = run_engine(
        _runner(tiny_model_dir), [(prompts[1], valid), (prompts[2], plain)], pipelined, **LIMITS
    )
    assert run.tokens[(1, 0)] == alone.tokens[(0, 0)] and run.tokens[(2, 0)] == alone.tokens[(1, 0)]
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(run.tokens[(1, 0)][:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert len(run.tokens[(2, 0)]) == 12


def test_allowed_tokens_all_banned_as_bad_words_fail_without_a_grammar(tiny_model_dir):
    """Processors alone: every allowed token is also a one-token bad word."""
    runner = _runner(tiny_model_dir)
    banned = SamplingParams(
        max_tokens=8, temperature=0.0, allowed_token_ids=(40, 41), bad_words=((40,), (41,))
    )
    fine = SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=(40, 41), bad_words=((40,),))
    run = run_engine(runner, [([5, 6], banned), ([5, 6], fine)], True, **LIMITS)
    assert run.errors.keys() == {0} and run.errors[0].kind == ErrorKind.INVALID_REQUEST
    assert run.tokens[(1, 0)] == [41] * 8


def test_a_bias_of_minus_100_on_every_allowed_token_is_not_a_mask(tiny_model_dir):
    """logit_bias adds, as vLLM's: -100 on every allowed token leaves them finite, the draw among them."""
    runner = _runner(tiny_model_dir)
    params = SamplingParams(
        max_tokens=8,
        temperature=1.0,
        seed=1,
        allowed_token_ids=(40, 41),
        logit_bias=((40, -100.0), (41, -100.0)),
    )
    run = run_engine(runner, [([5, 6], params)], **LIMITS)
    assert not run.errors and set(run.tokens[(0, 0)]) <= {40, 41} and len(run.tokens[(0, 0)]) == 8


@pytest.mark.parametrize("logprobs", [None, 2], ids=["tokens", "with-logprobs"])
def test_the_sampler_flags_rows_with_nothing_to_draw(logprobs):
    """Rows whose processors mask every token (greedy or drawn) are flagged in the one copy with the tokens,
    in both of its layouts; a step without processors or a bitmask carries no flags at all."""
    vocab = 64
    rules = [dict(), dict(allowed_token_ids=(3,), bad_words=((3,),)), dict(), dict(allowed_token_ids=(3, 4))]
    rules[3]["bad_words"] = ((3,), (4,))
    temperatures = (0.0, 0.0, 1.0, 1.0)
    seqs = [
        Seq(SamplingParams(temperature=t, seed=1, logprobs=logprobs, **r), [9, 10], 2)
        for t, r in zip(temperatures, rules, strict=True)
    ]
    position = np.full(4, 2)
    logits = torch.randn(4, vocab)
    pt = LogitsProcessors(vocab, (2,), "cpu").prepare(seqs, position)
    params = [s.params for s in seqs]
    tensors = SamplingTensors.from_params(params, np.ones(4, np.uint64), position, "cpu", pt)
    copy = sample_tensors(logits, tensors).start_copy()
    tokens, _ = copy.wait()
    assert copy.flagged and copy.masked_rows == [1, 3]
    assert len(tokens) == 4 and all(0 <= t < vocab for t in tokens)
    plain = SamplingTensors.from_params(params[:1] + params[2:3], np.ones(2, np.uint64), position[:2], "cpu")
    copy = sample_tensors(logits[[0, 2]], plain).start_copy()
    assert len(copy.wait()[0]) == 2 and not copy.flagged and copy.masked_rows == []
    nan = logits[[0, 2]].clone()
    nan[1] = float("nan")
    bitmask_free = replace(plain, processors=pt_for(seqs[0], vocab))
    copy = sample_tensors(nan, bitmask_free).start_copy()
    copy.wait()
    assert copy.masked_rows == [1]  # NaN logits: nothing sane to draw either


def pt_for(seq: Seq, vocab: int):
    """Processor tensors that mask nothing (every token allowed): the step counts as processed."""
    every = msgspec.structs.replace(seq.params, allowed_token_ids=tuple(range(vocab)))
    return LogitsProcessors(vocab, (2,), "cpu").prepare([replace(seq, params=every)], np.full(1, 2))


def test_masked_rows_map_to_their_sequences_with_drafts():
    assert masked_seq_ids([7, 8, 9], [0, 2]) == [7, 9]
    spec = SpecBatch.__new__(SpecBatch)
    spec.offsets = torch.tensor([0, 3, 4]).numpy()
    spec.counts = torch.tensor([3, 1, 2]).numpy()
    # rows 0-2: seq 7, row 3: seq 8, rows 4-5: seq 9, row 6: fork child 10
    assert masked_seq_ids([7, 8, 9, 10], [1, 2, 5, 6], spec) == [7, 9, 10]
