"""worker/logits_processors.py against a PyTorch reference written here, one row and one rule at a time:
penalties, logit_bias, min_p, min_tokens, bad_words and allowed_token_ids; the device-side token history
against the tokens it stands for; and the sampler with processors (raw logprobs, reproducible draws)."""

from __future__ import annotations

import gc
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.logits_processors import TAIL, LogitsProcessors, TokenHistory, apply_processors
from pagedserve.worker.sampler import SamplingTensors, sample_tensors

VOCAB = 64
EOS = (2,)


@dataclass
class Seq:
    """What the processors read of a worker sequence (worker/sequences.py SeqState)."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    pending: int = 0
    seed: int = 0

    @property
    def processed(self) -> bool:
        return self.params.processed


def reference(logits: torch.Tensor, seq: Seq) -> torch.Tensor:
    """One row [V] processed as vLLM's sampler does, written with Python loops over tokens, float64."""
    p = seq.params
    x = logits.double().clone()
    prompt, output = seq.token_ids[: seq.prompt_len], seq.token_ids[seq.prompt_len :]
    if p.allowed_token_ids:
        keep = torch.zeros(len(x), dtype=torch.bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = float("-inf")
    for word in p.bad_words:
        head = list(word[:-1])
        if not head or (len(output) >= len(head) and output[len(output) - len(head) :] == head):
            x[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        probs = torch.softmax(x / p.temperature, dim=-1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    return x


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(8)
    kw: dict = dict(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), max_tokens=64)
    if kind == 0:
        return SamplingParams(**kw)  # plain: untouched
    if kind in (1, 7):
        kw |= dict(
            presence_penalty=rng.uniform(-2, 2),
            frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.uniform(0.2, 2),
        )
    if kind in (2, 7):
        kw["min_p"] = rng.uniform(0.01, 0.5)
    if kind in (3, 7):
        tokens = rng.sample(range(VOCAB), rng.randrange(1, 8))
        kw["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in tokens)
    if kind == 4:
        kw["allowed_token_ids"] = tuple(rng.sample(range(VOCAB), rng.randrange(1, 10)))
    if kind in (5, 7):
        kw["bad_words"] = tuple(
            tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4)))
            for _ in range(rng.randrange(1, 5))
        )
    if kind == 6:
        kw |= dict(min_tokens=rng.randrange(1, 10), stop_token_ids=(5, 9), ignore_eos=rng.random() < 0.3)
    return SamplingParams(**kw)


def random_seq(rng: random.Random) -> Seq:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    # few distinct tokens, so that repeats and bad-word prefixes occur
    output = [rng.randrange(8) for _ in range(rng.randrange(0, 12))]
    return Seq(random_params(rng), prompt + output, len(prompt))


def assert_rows_match(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-5, atol=1e-4)


def test_every_rule_matches_the_reference_over_random_batches() -> None:
    rng = random.Random(0)
    for _ in range(20):
        seqs = [random_seq(rng) for _ in range(rng.randrange(1, 12))]
        processors = LogitsProcessors(VOCAB, EOS, "cpu")
        logits = torch.randn(len(seqs), VOCAB) * 3
        pt = processors.prepare(seqs, np.array([len(s.token_ids) for s in seqs]))
        got = logits.clone() if pt is None else apply_processors(logits, pt)
        for j, seq in enumerate(seqs):
            assert_rows_match(got[j], reference(logits[j], seq))


def test_the_raw_logits_are_left_alone_for_the_logprobs() -> None:
    seq = Seq(SamplingParams(presence_penalty=1.0, logprobs=3), [1, 2, 3, 3], 2)
    processors = LogitsProcessors(VOCAB, EOS, "cpu")
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    pt = processors.prepare([seq], np.array([4]))
    tensors = SamplingTensors.from_params([seq.params], np.array([7], np.uint64), np.array([4]), "cpu", pt)
    tokens, logprobs = sample_tensors(logits, tensors).start_copy().wait()
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before[0], dim=-1)
    assert logprobs[0] is not None and logprobs[0].logprob == pytest.approx(raw[tokens[0]].item(), abs=1e-6)


def test_greedy_takes_the_argmax_of_the_processed_logits() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 5.0, 4.0
    seq = Seq(SamplingParams(temperature=0.0, frequency_penalty=2.0), [1, 7], 1)  # 7 was generated once
    pt = LogitsProcessors(VOCAB, EOS, "cpu").prepare([seq], np.array([2]))
    tensors = SamplingTensors.from_params([seq.params], np.zeros(1, np.uint64), np.array([2]), "cpu", pt)
    assert sample_tensors(logits, tensors).start_copy().wait()[0] == [8]


def test_allowed_token_ids_and_min_p_bound_what_is_drawn() -> None:
    rng = random.Random(3)
    allowed = (3, 10, 40)
    seqs = [Seq(SamplingParams(allowed_token_ids=allowed, temperature=1.5), [1], 1)]
    seqs.append(Seq(SamplingParams(min_p=0.5, temperature=1.0), [1], 1))
    processors = LogitsProcessors(VOCAB, EOS, "cpu")
    logits = torch.randn(2, VOCAB)
    logits[1, 20] = 10.0  # tokens below half of its probability are dropped
    ref = reference(logits[1], seqs[1])
    kept = set(torch.isfinite(ref).nonzero().flatten().tolist())
    for position in range(200):
        pos = np.array([1 + position, 1 + position])
        pt = processors.prepare(seqs, np.array([1, 1]))
        seed = np.array([rng.getrandbits(63), rng.getrandbits(63)], np.uint64)
        tensors = SamplingTensors.from_params([s.params for s in seqs], seed, pos, "cpu", pt)
        tokens, _ = sample_tensors(logits, tensors).start_copy().wait()
        assert tokens[0] in allowed and tokens[1] in kept


def test_history_follows_the_sampled_tokens_step_after_step() -> None:
    """The device-side counts, prompt mask and last tokens, updated from each step's draws, are what a
    rebuild from the token lists gives, and the processed logits match the reference at every step."""
    rng = random.Random(5)
    seqs = []
    for _ in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        params = SamplingParams(
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            bad_words=((4, 5), (6, 6, 7)),
            temperature=1.0,
            max_tokens=64,
        )
        seqs.append(Seq(params, prompt, len(prompt)))
    seqs.append(Seq(SamplingParams(), [1, 2], 2))  # a plain batch-mate
    processors = LogitsProcessors(VOCAB, EOS, "cpu")
    for _ in range(40):
        logits = torch.randn(len(seqs), VOCAB)
        logits[:, :8] += 2  # draw from few tokens, so that they repeat
        position = np.array([len(s.token_ids) for s in seqs])
        pt = processors.prepare(seqs, position)
        assert pt is not None
        for j, seq in enumerate(seqs):
            assert_rows_match(apply_processors(logits, pt)[j], reference(logits[j], seq))
        seed = np.arange(len(seqs), dtype=np.uint64) + 11
        tensors = SamplingTensors.from_params([s.params for s in seqs], seed, position, "cpu", pt)
        tokens, _ = sample_tensors(logits, tensors).start_copy().wait()
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
    history = processors.history
    slots = history.slots(seqs[:-1])
    for seq, slot in zip(seqs, slots.tolist(), strict=False):
        output = seq.token_ids[seq.prompt_len :]
        counts = torch.bincount(torch.tensor(output), minlength=VOCAB).int()
        assert torch.equal(history.counts[slot], counts)
        assert set(history.in_prompt[slot].nonzero().flatten().tolist()) == set(
            seq.token_ids[: seq.prompt_len]
        )
        last = output[-TAIL:]
        assert history.tail[slot].tolist() == [-1] * (TAIL - len(last)) + last


def test_a_recreated_sequence_is_rebuilt_and_a_dead_ones_slot_reused() -> None:
    history = TokenHistory(VOCAB, "cpu", capacity=2)
    a, b = Seq(SamplingParams(), [1, 2, 3], 2), Seq(SamplingParams(), [4, 5, 5], 1)
    slot_a, slot_b = history.slots([a, b]).tolist()
    history.record(torch.tensor([slot_a]), torch.tensor([9]))
    assert history.counts[slot_a, 9] == 1 and history.counts[slot_a, 3] == 1
    # a preempted sequence comes back as a new object with the same tokens (plus the one generated)
    again = Seq(SamplingParams(), [1, 2, 3, 9], 2)
    del a
    gc.collect()
    (slot,) = history.slots([again]).tolist()
    assert history.capacity == 2 and slot == slot_a  # the dead one's slot, refilled
    assert history.counts[slot, 9] == 1 and history.counts[slot, 3] == 1 and history.counts[slot].sum() == 2
    c = Seq(SamplingParams(), [7], 1)
    history.slots([c, b, again])
    assert history.capacity == 4 and history.num_used == 3  # grown: all three live
    assert history.counts[slot_b, 5] == 2


def test_a_sequence_draws_the_same_token_whatever_its_batch_mates() -> None:
    rng = random.Random(9)
    target = Seq(
        SamplingParams(
            presence_penalty=1.0, repetition_penalty=1.5, min_p=0.05, top_p=0.9, logit_bias=((3, 2.0),)
        ),
        [1, 2, 3, 3, 4],
        3,
        seed=1234,
    )
    row = torch.randn(VOCAB)
    drawn = set()
    for size in (1, 3, 8):
        mates = [random_seq(rng) for _ in range(size - 1)]
        seqs = mates + [target]
        logits = torch.cat([torch.randn(size - 1, VOCAB), row[None]])
        processors = LogitsProcessors(VOCAB, EOS, "cpu")
        position = np.array([len(s.token_ids) for s in seqs])
        pt = processors.prepare(seqs, position)
        seed = np.array([s.seed for s in seqs], np.uint64)
        tensors = SamplingTensors.from_params([s.params for s in seqs], seed, position, "cpu", pt)
        drawn.add(sample_tensors(logits, tensors).start_copy().wait()[0][-1])
    assert len(drawn) == 1


def test_out_of_range_values_are_refused_by_validate() -> None:
    bad = [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-2.01),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=2.5),
        dict(min_p=1.5),
        dict(min_p=float("nan")),
        dict(min_tokens=17, max_tokens=16),
        dict(logit_bias=((1, 101.0),)),
        dict(logit_bias=((1, 1.0), (1, 2.0))),
        dict(bad_words=((),)),
        dict(bad_words=(tuple(range(33)),)),
        dict(allowed_token_ids=(-1,)),
        dict(beam_width=2, temperature=0.0, presence_penalty=0.5),
    ]
    for kw in bad:
        assert SamplingParams(**kw).validate() is not None, kw
    assert SamplingParams(logit_bias=((5, 1.0),)).vocab_problem(5) is not None
    assert SamplingParams(bad_words=((1, 70),)).vocab_problem(64) is not None
    assert SamplingParams(allowed_token_ids=(1, 63)).vocab_problem(64) is None


def test_min_tokens_has_no_work_once_reached() -> None:
    processors = LogitsProcessors(VOCAB, EOS, "cpu")
    seq = Seq(SamplingParams(min_tokens=2, stop_token_ids=(9, 1000)), [1, 2, 3], 2)  # one generated
    pt = processors.prepare([seq], np.array([3]))
    assert pt is not None and sorted(pt.ban_ids.tolist()) == [2, 9]  # EOS and the stop id in the vocabulary
    seq.token_ids.append(4)
    assert processors.prepare([seq], np.array([4])) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_processors_match_the_reference_and_never_wait_for_the_device() -> None:
    """The same rules on the GPU, with a 128k vocabulary's worth of columns, and no host synchronization
    from building the columns to the draw (the runner queues the sampler behind a forward in flight)."""
    rng = random.Random(2)
    device = torch.device("cuda")
    seqs = [random_seq(rng) for _ in range(64)]
    for seq in seqs:
        seq.params = SamplingParams(
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.05, top_p=0.9,
            min_tokens=3, logit_bias=((5, 2.0),), bad_words=((4, 5), (6,)), max_tokens=64,
        )  # fmt: skip
    processors = LogitsProcessors(VOCAB, EOS, device)
    position = np.array([len(s.token_ids) for s in seqs])
    processors.prepare(seqs, position)  # fills the histories (one pinned copy)
    logits = torch.randn(len(seqs), VOCAB, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pt = processors.prepare(seqs, position)
        assert pt is not None
        processed = apply_processors(logits, pt)
        seed = np.arange(len(seqs), dtype=np.uint64)
        tensors = SamplingTensors.from_params([s.params for s in seqs], seed, position, device, pt)
        out = sample_tensors(logits, tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.start_copy().wait()
    for j, seq in enumerate(seqs):
        assert_rows_match(processed[j].cpu(), reference(logits[j].cpu(), seq))
