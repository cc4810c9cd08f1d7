"""The batched grammar path of structured output (worker/grammar_batch.py through worker/structured.py):
its bitmasks are exactly those of one xgrammar matcher per sequence advanced and filled one call at a time,
and the worker's step launches the forward pass before it waits for, advances or fills any matcher."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
from pagedserve.worker.grammar_batch import (
    MIN_MEASURED_ROWS,
    PROBE_EVERY,
    WORK_PER_THREAD_S,
    GrammarBatch,
    Matcher,
    advance_and_fill,
)
from pagedserve.worker.sequences import SeqState
from pagedserve.worker.structured import StructuredOutputs, _json_safe_words, apply_token_bitmask
from tests.structured_schemas import random_schema
from tests.test_structured_output import _assert_valid, _prompts, _run, _runner, _schema_params

PADDED_VOCAB = 4096 + 96  # logits wider than the tokenizer: the ids past it are never allowed


class _PerMatcher:
    """The reference: one GrammarMatcher per sequence, each token accepted and each row filled by its own
    call; a finished or broken matcher's row allows only the stop tokens; JSON rows lose control bytes."""

    def __init__(self, tokenizer, eos: int, vocab_size: int) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab_size, self.eos = vocab_size, eos
        self.matchers: dict[int, xgr.GrammarMatcher | None] = {}
        self.json_words = {ws: _json_safe_words(self.info.decoded_vocab, vocab_size, ws) for ws in (0, 1)}

    def add(self, seq_id: int, structured: StructuredOutput) -> None:
        if structured.kind == "json_schema":
            compiled = self.compiler.compile_json_schema(
                structured.spec, any_whitespace=structured.any_whitespace
            )
        else:
            compiled = self.compiler.compile_regex(structured.spec)
        self.matchers[seq_id] = xgr.GrammarMatcher(compiled, override_stop_tokens=[self.eos])

    def accept(self, seq_id: int, token: int) -> None:
        m = self.matchers[seq_id]
        if m is not None and not m.is_terminated() and not m.accept_token(token):
            self.matchers[seq_id] = None

    def row(self, seq_id: int, structured: StructuredOutput) -> torch.Tensor:
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        m = self.matchers[seq_id]
        if m is None or m.is_terminated():
            mask.zero_()
            mask[0, self.eos // 32] = 1 << (self.eos % 32)
        else:
            m.fill_next_token_bitmask(mask, 0)
        if structured.kind == "json_schema":
            mask &= self.json_words[int(structured.any_whitespace)]
        return mask[0]


def _draw(row: torch.Tensor, rng: random.Random, vocab_size: int) -> int:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits).tolist()
    return rng.choice(allowed) if allowed else 0


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


def _no_probes(batch: GrammarBatch):
    """`batch.run` with the row cost it was given kept and no single-thread probes: every fill on all its
    threads."""
    run, cost = batch.run, batch.row_fill_s

    def run_on_all(*args, **kwargs):
        batch._parallel_fills = 0
        out = run(*args, **kwargs)
        assert batch.last_threads == batch.threads
        batch.row_fill_s = cost
        return out

    return run_on_all


@pytest.mark.parametrize("device", ["cpu", CUDA])  # CUDA: the pinned buffers, reused in turn
@pytest.mark.parametrize("threads,ahead", [(1, False), (3, False), (3, True)])
def test_batched_masks_equal_per_matcher_masks_over_random_schemas(tiny_model_dir, threads, ahead, device):
    """24 rows (20 random schemas, 2 regexes, 2 free rows) over 40 steps, each row drawing at random among
    its allowed tokens; now and then a row skips a step (its matcher then accepts two tokens at once), is
    recomputed (a fresh matcher replays the whole output), draws a token its grammar refuses (its matcher
    breaks) or EOS when allowed. With `ahead`, most steps' rows fill ahead of the next step in the background
    (as when a step is answered before the next plan: `prefetch(None, ...)`), and the recomputed row's
    matcher is dropped while that runs: the next step takes the masks of the rows still current; now and
    then the rows fill ahead before their tokens come (they are redone)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    device = torch.device(device)
    structured = StructuredOutputs(str(tiny_model_dir), PADDED_VOCAB, [eos], device, threads)
    if threads > 1:  # every fill on all the threads (the tiny tokenizer's rows alone would take one)
        structured.batch.row_fill_s = 1.0
        structured.batch.run = _no_probes(structured.batch)
    reference = _PerMatcher(tokenizer, eos, PADDED_VOCAB)
    rng = random.Random(threads)
    specs: list[StructuredOutput | None] = [
        StructuredOutput("json_schema", json.dumps(random_schema(rng)), any_whitespace=i % 3 == 0)
        for i in range(20)
    ]
    specs += [StructuredOutput("regex", r"[a-z]{2,12}( [0-9]+)?"), None, StructuredOutput("regex", "(ab)+c")]
    specs.insert(7, None)
    seqs: dict[int, SeqState] = {}
    for seq_id, spec in enumerate(specs):
        params = SamplingParams(max_tokens=1000, structured=spec)
        seqs[seq_id] = SeqState([1, 2, 3], 3, params, seq_id, -1, seq_id, prompt_len=3)
        if spec is not None:
            reference.add(seq_id, spec)
    reused = 0
    made = []  # (step, mask, expected rows): compared at the end, so that CUDA reuses buffers unsynchronized
    for step in range(40):
        sampling = [i for i in seqs if rng.random() > 0.1 or step == 0]  # the others skip this step
        mask = structured.bitmask(step, sampling, [seqs[i] for i in sampling], dict, device)
        reused += structured.last_stats["reused_rows"]
        constrained = [i for i in sampling if specs[i] is not None]
        assert mask is not None
        assert mask.rows.tolist() == [j for j, i in enumerate(sampling) if specs[i] is not None]
        made.append((step, mask, [(seq_id, reference.row(seq_id, specs[seq_id])) for seq_id in constrained]))
        early = ahead and rng.random() < 0.25  # ahead of tokens that come after: those rows are redone
        if early:
            structured.prefetch(None, sampling, [seqs[i] for i in sampling])
        for seq_id in seqs:  # every row gains a token: one that skipped the step catches up later
            spec = specs[seq_id]
            if spec is None or rng.random() < 0.02:
                token = rng.randrange(PADDED_VOCAB)  # a free row, or a token the grammar may refuse
            else:
                row = reference.row(seq_id, spec)
                token = _draw(row, rng, PADDED_VOCAB)
                if token == eos and rng.random() < 0.5:
                    token = _draw(row, rng, PADDED_VOCAB)
            seqs[seq_id].token_ids.append(token)
            if spec is not None:
                reference.accept(seq_id, token)
        if ahead and not early and rng.random() < 0.8:
            structured.prefetch(None, sampling, [seqs[i] for i in sampling])
        if step % 8 == 7:  # recomputed after preemption: a fresh matcher replays the whole output
            structured.matchers.pop(rng.choice(constrained), None)
    num_compared = 0
    for step, mask, expected in made:
        for k, (seq_id, row) in enumerate(expected):
            # (the JSON-safe words are ANDed in by the mask kernel, from the row's `extra` row)
            got = (mask.bitmask[k] & mask.extra[mask.kinds[k]]).cpu()
            # (the masks are as wide as the tokenizer: the kernel bans the tokens past their words)
            got = torch.nn.functional.pad(got, (0, len(row) - len(got)))
            assert torch.equal(got, row), f"step {step}, sequence {seq_id}"
            num_compared += 1
    structured.close()
    assert num_compared > 600
    assert not ahead or reused > 100  # rows whose masks were filled ahead
    assert any(m is None for m in reference.matchers.values())  # a broken grammar was compared too
    assert any(m is not None and m.is_terminated() for m in reference.matchers.values())


def test_the_step_launches_the_forward_before_the_masks(tiny_model_dir):
    """As the worker's loop runs steps (worker/server.py): step N+1's forward is queued, then step N is
    finished, then step N+1's sampler. A step's own matchers advance and fill only after its forward is
    queued and after the previous step's tokens are on the host (in the background when step N's answer
    starts: prefetched); step N's rows advance and fill earlier, in a thread that waits for step N's
    tokens to reach the host (`prefill_after`), and step N+1 takes those rows' masks; its launch takes the
    masks prefetched for it as they are. The outputs are valid documents."""
    runner = _runner(tiny_model_dir, 400)
    events: list[tuple[str, int]] = []
    launch_forward, finish = runner.launch_forward, runner.finish
    host_masks = runner.structured._host_masks
    received = runner.sequences.received
    finishing = [-1]
    prefetched: list[int] = []  # the steps whose fill ran in the background, started by `finish`
    ahead: list[int] = []  # the steps whose rows filled ahead of the next plan
    reused: list[int] = []  # rows of a step's masks filled ahead
    launching: list[int] = []  # the steps whose rows the launching thread went through itself

    def traced_forward(plan):
        forwarded = launch_forward(plan)
        events.append(("forward", plan.step_id))
        return forwarded

    def traced_finish():
        finishing[0] = runner.in_flight[0].step_id
        out = finish()
        events.append(("answered", out.step_id))
        return out

    def traced_received(samplers, tokens):
        events.append(("received", finishing[0]))
        return received(samplers, tokens)

    def traced_host_masks(step_id, seq_ids, samplers, pending_tokens, filled=None, ends=None):
        if step_id is None:  # ahead of the plan: a step's rows, once its tokens are on the host
            assert ends is not None  # (the thread waits for the step's copy: `prefill_after`)
            tokens = pending_tokens()
            assert set(tokens) >= set(seq_ids)  # (their pending flags may be cleared by now)
            ahead.append(1)
        else:
            events.append(("fill", step_id))
            if threading.current_thread().name.startswith("grammar-prefetch"):
                prefetched.append(step_id)
            else:
                launching.append(step_id)
        masks = host_masks(step_id, seq_ids, samplers, pending_tokens, filled, ends)
        if step_id is not None and masks is not None:
            reused.append(masks.reused)
        return masks

    runner.sequences.received = traced_received
    runner.launch_forward, runner.finish = traced_forward, traced_finish
    runner.structured._host_masks = traced_host_masks
    schemas, params = _schema_params(seed=5, num=8)
    outputs, _ = _run(runner, _prompts(8, 2), params, "worker", max_num_seqs=8, max_num_batched_tokens=128)
    _assert_valid(runner, outputs, schemas, tiny_model_dir)
    position = {event: k for k, event in enumerate(events)}
    fills = [step_id for kind, step_id in events if kind == "fill"]
    assert len(fills) > 20
    pipelined = 0
    for step_id in fills:
        assert position[("forward", step_id)] < position[("fill", step_id)]
        tokens = position.get(("received", step_id - 1))
        if tokens is not None and position[("forward", step_id)] < tokens:
            # step N-1 was still in flight when step N's forward was queued: its tokens reached the
            # host after that, and the fill came after them
            assert tokens < position[("fill", step_id)]
            pipelined += 1
    assert pipelined > 10 and len(prefetched) > 10
    # (the prefetched steps' rows come mostly from the fills ahead)
    assert len(ahead) > 10 and sum(r > 0 for r in reused) > 10
    # the masks prefetched for a step are its masks: the launch takes them without going over its rows
    assert not set(prefetched) & set(launching)


def test_masks_are_as_wide_as_the_tokenizer_and_ban_the_ids_past_it(tiny_model_dir):
    """Logits wider than the tokenizer: the masks cover the tokenizer's ids only (the kernel bans the rest),
    and a request's stop token past the tokenizer's vocabulary is not allowed, without breaking its grammar;
    EOS still ends the document."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(str(tiny_model_dir), PADDED_VOCAB, [eos], torch.device("cpu"), 1)
    params = SamplingParams(
        max_tokens=100, stop_token_ids=(PADDED_VOCAB - 1,), structured=StructuredOutput("regex", "ab")
    )
    seq = SeqState([1, 2, 3], 3, params, 0, -1, 0, prompt_len=3)
    logits = torch.zeros(1, PADDED_VOCAB)
    for step, text in enumerate(["a", "b", None]):
        mask = structured.bitmask(step, [0], [seq], dict, torch.device("cpu"))
        assert mask is not None and mask.bitmask.shape == (1, -(-len(tokenizer) // 32))
        allowed = torch.isfinite(apply_token_bitmask(logits.clone(), mask)[0]).nonzero().flatten().tolist()
        assert max(allowed) < len(tokenizer)  # nothing past the tokenizer, the stop token included
        expected = tokenizer.convert_tokens_to_ids(text) if text else eos
        assert expected in allowed and (text is None) == (allowed == [eos])
        seq.token_ids.append(expected)
    assert structured.take_failed(0) == [] and structured.matchers[0].matcher is not None
    structured.close()


@pytest.mark.parametrize("order", ["worker", False], ids=["worker-loop", "sync"])
def test_the_launch_trace_records_each_steps_masks(tiny_model_dir, order):
    """With the step trace on (worker/launch_trace.py), each answered step carries its masks' costs: its
    constrained rows, the rows taken from masks filled ahead, the host times; off CUDA there are no GPU
    events, and nothing stays behind once the steps are answered. In the worker loop's order the plan of
    step N+1 is there when step N finishes (its masks fill behind its forward: ahead 1); run one step at a
    time, step N's rows fill ahead of plan N+1 (ahead 2) and step N+1 takes their masks."""
    runner = _runner(tiny_model_dir, 400)
    runner.trace_launches = True
    finish = runner.finish
    splits: dict[int, dict[str, float]] = {}

    def traced_finish():
        out = finish()
        splits[out.step_id] = runner.launch_trace.take(out.step_id)
        if out.seq_ids:
            split = splits[out.step_id]
            assert split["structured_rows"] == len(out.seq_ids)  # every row is constrained here
        return out

    runner.finish = traced_finish
    schemas, params = _schema_params(seed=6, num=8)
    outputs, _ = _run(runner, _prompts(8, 3), params, order, max_num_seqs=8, max_num_batched_tokens=128)
    _assert_valid(runner, outputs, schemas, tiny_model_dir)
    sampled = [s for s in splits.values() if s]
    assert len(sampled) > 20
    for split in sampled:
        assert 0 <= split["structured_reused_rows"] <= split["structured_rows"]
        assert split["structured_ahead"] in (0, 1, 2)
        assert min(split[f"structured_{k}_ms"] for k in ("wait", "host", "accept", "fill", "copy")) >= 0
        assert "sampler_wait_gpu_ms" not in split  # (CUDA only)
    ahead = 1 if order == "worker" else 2
    assert sum(s["structured_ahead"] == ahead and s["structured_reused_rows"] > 0 for s in sampled) > 20
    # the masks filled ahead bring their accept and fill with them (they were lost on the way before)
    reused = [s for s in sampled if s["structured_reused_rows"] == s["structured_rows"]]
    assert reused and all(s["structured_fill_ms"] > 0 for s in reused)
    assert all(s["structured_fill_threads"] >= 1 for s in sampled)
    assert not runner.launch_trace._open and not runner.launch_trace._done


def test_the_workers_grammar_threads_reach_xgrammar(tiny_model_dir):
    """--grammar-threads sets the batch matcher's threads; 0 leaves the default (from the cores)."""
    from pagedserve.worker.grammar_batch import default_grammar_threads
    from tests.test_model_runner import make_runner

    assert make_runner(tiny_model_dir, grammar_threads=3).structured.batch.threads == 3
    assert make_runner(tiny_model_dir).structured.batch.threads == default_grammar_threads()


def test_a_fill_takes_the_threads_its_rows_work_pays_for():
    """One thread until a row's work is measured; then one per WORK_PER_THREAD_S of expected work, at most
    `threads`; every PROBE_EVERY-th fill that would take several takes one, to measure again."""
    batch = GrammarBatch(8)
    assert batch.threads_for(450) == 1  # not measured yet
    batch.row_fill_s = 0.4e-6  # the benchmark tokenizer's rows: 450 of them are 0.18 ms
    assert batch.threads_for(450) == 1
    batch.row_fill_s = WORK_PER_THREAD_S * 4 / 450
    assert batch.threads_for(450) == 4 and batch.threads_for(45) == 1
    batch.row_fill_s = 30e-6  # a 128k-token tokenizer's costly rows
    assert batch.threads_for(450) == 8
    batch._parallel_fills = PROBE_EVERY
    assert batch.threads_for(450) == 1


def test_fills_measure_a_rows_work_on_one_thread_only(tiny_model_dir):
    """A run on one thread sets the row cost (its accept's and fill's seconds / rows filled); runs on
    several leave it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(str(tiny_model_dir), PADDED_VOCAB, [eos], torch.device("cpu"), 4)
    grammar = structured._compiler.result().compile_regex("[a-z]{1,40}")
    states = [Matcher(xgr.GrammarMatcher(grammar), (eos,)) for _ in range(2 * MIN_MEASURED_ROWS)]
    mask = torch.zeros(len(states), -(-structured.mask_vocab_size // 32), dtype=torch.int32)
    batch = structured.batch
    assert batch.run(states, [[] for _ in states], mask) == [] and batch.last_threads == 1
    measured = batch.row_fill_s
    assert measured == pytest.approx(sum(batch.last_spent) / len(states)) and measured > 0
    batch.row_fill_s = 1.0  # so that the next fill takes all 4 threads
    assert batch.run(states, [[] for _ in states], mask) == [] and batch.last_threads == 4
    assert batch.row_fill_s == 1.0 and batch._parallel_fills == 1
    assert bool((mask != 0).any(dim=1).all())  # every row allows something


@pytest.mark.parametrize("core", [True, False])
def test_batch_accept_matches_one_matcher_at_a_time(tiny_model_dir, core, monkeypatch):
    """The batched accept (xgrammar's core call, or its public wrapper where the core is missing) feeds each
    matcher its token as its own accept_token does: None when all are accepted, else each one's acceptance,
    and the matchers' states (their next masks) as the one-at-a-time twins'."""
    from pagedserve.worker import grammar_batch

    if not core:
        monkeypatch.setattr(grammar_batch, "_BATCH_ACCEPT", None)
    else:
        assert grammar_batch._BATCH_ACCEPT is not None  # (the pinned xgrammar has it)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(str(tiny_model_dir), PADDED_VOCAB, [eos], torch.device("cpu"), 1)
    grammar = structured._compiler.result().compile_regex("[a-z]{1,20}( [0-9]{1,6})?")
    mine = [xgr.GrammarMatcher(grammar) for _ in range(40)]
    twins = [xgr.GrammarMatcher(grammar) for _ in range(40)]
    rng = random.Random(5)
    vocab = tokenizer.get_vocab()
    allowed = [t for w, t in vocab.items() if w.isalpha() and w.islower() and w.isascii()]
    refused = [t for w, t in vocab.items() if w and w[0] in "{}[]"]
    results = []
    for step in range(6):
        tokens = [rng.choice(refused if rng.random() < (0.1 if step else 0) else allowed) for _ in mine]
        want = [twin.accept_token(t) for twin, t in zip(twins, tokens, strict=True)]
        got = grammar_batch.batch_accept(mine, tokens)
        assert (got is None) == all(want)
        assert got is None or got == want
        results.append(got)
    assert results[0] is None and any(r is not None for r in results)  # both kinds of answer
    width = -(-structured.mask_vocab_size // 32)
    masks = [torch.zeros(1, width, dtype=torch.int32) for _ in range(2)]
    for m, twin in zip(mine, twins, strict=True):
        m.fill_next_token_bitmask(masks[0])
        twin.fill_next_token_bitmask(masks[1])
        assert torch.equal(masks[0], masks[1])


def test_chunked_runs_advance_and_fill_as_one_thread_does(tiny_model_dir):
    """A run on several threads of rows gaining one token at most (each chunk accepted and filled by one
    thread) ends as the one-thread run of twin matchers does: the same rows done (a stop token accepted, a
    token the grammar refuses, a matcher broken before), the same masks for the others, the same counts."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(str(tiny_model_dir), PADDED_VOCAB, [eos], torch.device("cpu"), 4)
    grammar = structured._compiler.result().compile_regex("[a-z]{1,30}")
    vocab = tokenizer.get_vocab()
    allowed = [t for w, t in vocab.items() if w.isalpha() and w.islower() and w.isascii() and len(w) < 4]
    refused = [t for w, t in vocab.items() if w and w[0] in "{}[]"]
    refused_ids = set(refused)
    width = -(-structured.mask_vocab_size // 32)
    rng = random.Random(11)
    pairs = [[Matcher(xgr.GrammarMatcher(grammar), (eos,), seq_id=i) for _ in range(2)] for i in range(61)]
    pairs[7][0].matcher = pairs[7][1].matcher = None  # broken before
    batch = structured.batch
    single = xgr.BatchGrammarMatcher(max_threads=1)
    for step in range(5):
        tokens = []
        for i in range(len(pairs)):
            r = rng.random()
            token = eos if r < 0.05 and step else rng.choice(refused) if r < 0.08 else rng.choice(allowed)
            tokens.append([] if i % 9 == 4 else [token])
        out_rows = rng.sample(range(len(pairs)), len(pairs))
        masks = [torch.zeros(len(pairs), width, dtype=torch.int32) for _ in range(2)]
        batch.row_fill_s = 1.0  # every run on the 4 threads
        batch._parallel_fills = 0
        live = {i for i, (mine, _) in enumerate(pairs) if mine.matcher is not None and not mine.terminated}
        done = batch.run([p[0] for p in pairs], tokens, masks[0], out_rows)
        assert batch.last_threads == 4
        want = advance_and_fill(single, [p[1] for p in pairs], tokens, masks[1], out_rows)
        assert done == want and len(done) > step  # (some rows end at each step)
        for i, (mine, twin) in enumerate(pairs):
            assert (mine.matcher is None) == (twin.matcher is None)
            assert (mine.terminated, mine.num_fed) == (twin.terminated, twin.num_fed)
            if i in live and tokens[i] and tokens[i][0] in refused_ids:  # (a refused token breaks it)
                assert mine.matcher is None and i in done
            if i not in done:
                assert torch.equal(masks[0][out_rows[i]], masks[1][out_rows[i]])
    batch.close()
