"""Prompt scoring (`SamplingParams.prompt_logprobs`) through the real scheduler core and model runner,
against transformers' own model: each prompt token's logprob given the tokens before it, its rank and the top
k at its position, to 1e-4 in float32 on the CPU, whatever the chunking, batching, prefix caching and
preemption did to the prompt's prefill."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import (
    PromptLogprobs,
    SamplingParams,
    SeqOutput,
    StepOutput,
    SubmitRequest,
    TokenLogprobs,
)
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.prompt_logprobs import MAX_SCORED_ELEMENTS, PromptScores
from tests.engine_loop import idle, run_engine

K = 5


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row t - 1 is the log-softmax that scores prompt token t (transformers')."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _run(runner: ModelRunner, requests: list[tuple[list[int], SamplingParams]], pipelined=False, **kw):
    """Runs the requests to the end (each submitted when the one before it is done when `sequential`);
    returns each request's outputs in order and the scheduler (tests/engine_loop.py)."""
    arrive = idle if kw.pop("sequential", False) else None
    run = run_engine(runner, requests, pipelined, arrive=arrive, owner=b"t", **kw)
    return run.outputs, run.scheduler


def _prompt_logprobs(outputs: list[SeqOutput]) -> tuple[list[TokenLogprobs], list[int]]:
    """The request's prompt logprobs in order, checking that they come whole, once, before any token."""
    entries: list[TokenLogprobs] = []
    ranks: list[int] = []
    seen_token = False
    for out in outputs:
        if out.prompt_logprobs is not None:
            assert not seen_token, "a prompt logprob after a generated token"
            assert out.prompt_logprobs.start == len(entries) + 1, "a gap or a repeat"
            entries += out.prompt_logprobs.logprobs
            ranks += out.prompt_logprobs.ranks
        seen_token |= bool(out.token_ids)
    return entries, ranks


def _assert_matches(model, prompt: list[int], outputs: list[SeqOutput], k: int) -> None:
    entries, ranks = _prompt_logprobs(outputs)
    assert len(entries) == len(prompt) - 1
    ref = _reference(model, prompt)
    targets = torch.tensor(prompt[1:])
    expected = ref.gather(1, targets[:, None])[:, 0]
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    expected_rank = (ref > expected[:, None]).sum(1) + 1
    # a rank can differ only where the token ties with another within float noise
    assert all(
        r == int(er) or abs(float(ref[i].sort(descending=True).values[r - 1]) - float(expected[i])) < 1e-4
        for i, (r, er) in enumerate(zip(ranks, expected_rank, strict=True))
    )
    top = ref.topk(k, dim=-1)
    for i, e in enumerate(entries):
        assert len(e.top_token_ids) == k
        torch.testing.assert_close(torch.tensor(e.top_logprobs), top.values[i], atol=1e-4, rtol=0)
        # ids agree wherever the values are not tied
        assert [ref[i, t].item() for t in e.top_token_ids] == pytest.approx(top.values[i].tolist(), abs=1e-4)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 2, 9, 30, 61)]


def _runner(tiny_model_dir, num_kv_blocks=400, **kw) -> ModelRunner:
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks,
        **kw,
    )  # fmt: skip
    return ModelRunner(config)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_prompt_logprobs_of_a_chunked_batch_match_transformers(tiny_model_dir, hf_model, pipelined):
    runner = _runner(tiny_model_dir)
    prompts = _prompts(runner.vocab_size)
    ks = [K, 0, 3, K, 20]
    requests = [
        (p, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k))
        for p, k in zip(prompts, ks, strict=True)
    ]
    requests.append((prompts[3], SamplingParams(max_tokens=3, temperature=0.0)))  # asks for none
    # 16 tokens a step: the longer prompts take several chunks, batched with the others' chunks
    outputs, _ = _run(runner, requests, pipelined, max_num_seqs=8, max_num_batched_tokens=16)
    for i, (prompt, k) in enumerate(zip(prompts, ks, strict=True)):
        _assert_matches(hf_model, prompt, outputs[i], k)
        assert sum(len(o.token_ids) for o in outputs[i]) == 3
    assert all(o.prompt_logprobs is None for o in outputs[5])


def test_prompt_logprobs_with_n_and_a_prefix_cache_hit(tiny_model_dir, hf_model):
    """The prefix cache holds the first request's prompt; a second request with the same prefix and prompt
    logprobs computes it all again (a third without them takes the hit), and n > 1 reports them once."""
    runner = _runner(tiny_model_dir)
    base = _prompts(runner.vocab_size)[4]
    longer = base + [3, 1, 4, 1, 5]
    requests = [
        (base, SamplingParams(max_tokens=2, temperature=0.0)),
        (longer, SamplingParams(max_tokens=2, temperature=1.0, n=3, seed=1, prompt_logprobs=2)),
        (longer, SamplingParams(max_tokens=2, temperature=0.0)),
    ]
    outputs, scheduler = _run(runner, requests, sequential=True, max_num_seqs=8, max_num_batched_tokens=32)
    _assert_matches(hf_model, longer, outputs[1], 2)
    assert {o.index for o in outputs[1] if o.prompt_logprobs is not None} == {0}
    cached = [max(o.num_cached_tokens for o in outputs[i]) for i in range(3)]
    assert cached[1] == 0 and cached[2] > 0  # the hit went to the request that asked for no scores
    assert scheduler.metrics.prefix_cache_hits_total == cached[2]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_prompt_logprobs_survive_preemption_by_recompute(tiny_model_dir, hf_model, pipelined):
    """A pool too small for the batch: sequences are preempted and recomputed, prompts included, and every
    position is still reported exactly once."""
    runner = _runner(tiny_model_dir, num_kv_blocks=40)
    prompts = _prompts(runner.vocab_size)[2:] * 2
    requests = [(p, SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=K)) for p in prompts]
    outputs, scheduler = _run(
        runner, requests, pipelined, max_num_seqs=8, max_num_batched_tokens=16, preemption_mode="recompute"
    )
    assert scheduler.metrics.preemptions_total >= 2
    for i, prompt in enumerate(prompts):
        _assert_matches(hf_model, prompt, outputs[i], K)


def test_scoring_is_chunked_by_memory_not_by_prompt(tiny_model_dir, hf_model, monkeypatch):
    """Rows go through the lm_head a bounded number at a time: a tiny bound gives the same numbers."""
    import pagedserve.worker.prompt_logprobs as module

    runner = _runner(tiny_model_dir)
    monkeypatch.setattr(module, "MAX_SCORED_ELEMENTS", 3 * runner.vocab_size)
    calls = []
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: calls.append(len(h)) or compute_logits(h))
    prompt = _prompts(runner.vocab_size)[4]
    params = SamplingParams(max_tokens=1, prompt_logprobs=4)
    outputs, _ = _run(runner, [(prompt, params)], max_num_seqs=2, max_num_batched_tokens=64)
    _assert_matches(hf_model, prompt, outputs[0], 4)
    assert max(calls) == 3 and MAX_SCORED_ELEMENTS >= 1 << 20


def test_select_takes_only_prompt_rows_of_the_asking_sequences():
    class Seq:
        def __init__(self, tokens, computed, k, prompt_len):
            self.token_ids, self.num_computed_tokens = tokens, computed
            self.params, self.prompt_len = SamplingParams(prompt_logprobs=k), prompt_len

    import numpy as np

    seqs = [
        Seq(list(range(10)), 0, 2, 10),  # first chunk of 4: scores tokens 1..4
        Seq(list(range(10)), 4, None, 10),  # asks for none
        Seq(list(range(20, 30)), 8, 1, 10),  # last chunk: positions 8, 9; only 8 scores (token 9)
        Seq(list(range(12)), 10, 1, 10),  # decoding: nothing of the prompt left
    ]
    qsl = np.array([0, 4, 8, 10, 11])
    scores = PromptScores.select([7, 8, 9, 10], seqs, [4, 4, 2, 1], qsl, torch.from_numpy)
    assert scores is not None
    assert scores.seq_ids == [7, 9] and scores.starts == [1, 9] and scores.counts == [4, 1]
    assert scores.rows.tolist() == [0, 1, 2, 3, 8] and scores.targets.tolist() == [1, 2, 3, 4, 29]
    assert PromptScores.select([8, 10], [seqs[1], seqs[3]], [4, 1], qsl[2:], torch.from_numpy) is None


def test_check_output_refuses_bad_prompt_logprobs(tiny_model_dir):
    settings = SchedulerSettings(
        num_kv_blocks=64, block_size=4, max_model_len=128, vocab_size=100, eos_token_ids=(0,),
        max_num_seqs=4, max_num_batched_tokens=4,
    )  # fmt: skip
    scheduler = Scheduler(settings)
    prompt = list(range(1, 11))
    assert scheduler.add_request(b"t", SubmitRequest("a", prompt, SamplingParams(prompt_logprobs=1))) is None
    plan = scheduler.schedule()  # 4 of the 10 prompt tokens: scores tokens 1..4
    seq_id = plan.scheduled_seq_ids[0]

    def out(chunk: PromptLogprobs) -> StepOutput:
        return StepOutput(plan.step_id, [], [], [], prompt_logprobs=[(seq_id, chunk)])

    def entry(k=1):
        return TokenLogprobs(-1.0, [5] * k, [-0.5] * k)

    good = PromptLogprobs(1, [entry() for _ in range(4)], [2] * 4)
    assert scheduler.check_output(out(good)) is None
    bad = [
        PromptLogprobs(1, [entry(2)], [1]),  # two alternatives, one asked for
        PromptLogprobs(1, [entry()], [0]),  # rank 0
        PromptLogprobs(1, [TokenLogprobs(float("nan"), [5], [-1.0])], [1]),
        PromptLogprobs(1, [entry()] * 10, [1] * 10),  # 10 scores for 9 scorable tokens
    ]
    for chunk in bad:
        assert scheduler.check_output(out(chunk)) is not None, chunk
    outputs = scheduler.update(out(good))
    assert [o.prompt_logprobs.start for _, o in outputs] == [1]
    # a repeat of sent positions (a recompute) is dropped, the new part forwarded from where it stopped
    plan = scheduler.schedule()
    again = StepOutput(
        plan.step_id, [], [], [], prompt_logprobs=[(seq_id, PromptLogprobs(3, [entry()] * 4, [1] * 4))]
    )
    assert scheduler.check_output(again) is None
    ((_, o),) = scheduler.update(again)
    assert o.prompt_logprobs.start == 5 and len(o.prompt_logprobs.logprobs) == 2
