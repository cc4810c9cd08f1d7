"""ModelRunner driven by StepPlans on the tiny checkpoint, against transformers' LlamaForCausalLM."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import NewSequence, SamplingParams, StepOutput, StepPlan
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.plan_check import PlanError

BLOCK_SIZE = 16
NUM_BLOCKS = 48


def make_runner(model_dir: Path, num_kv_blocks: int = NUM_BLOCKS, **config_kw) -> ModelRunner:
    config = dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks)
    cfg = WorkerConfig(model=str(model_dir), **{**config, **config_kw})
    return ModelRunner(cfg, attention_backend=cfg.resolved_attention_backend)  # attention_backend= is obeyed


class Driver:
    """Plays the scheduler for one runner: shuffled block ids handed out as sequences grow, a mirror of each
    sequence's tokens, and a record of every logits row the runner samples from."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.step_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.pending: list[NewSequence] = []
        self.records: list[tuple[int, int, torch.Tensor]] = []  # (seq_id, last token index, logits row)
        self._rows: list[torch.Tensor] = []
        compute_logits = runner.model.compute_logits

        def recording(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            self._rows.extend(logits.clone())
            return logits

        runner.model.compute_logits = recording

    def add(self, seq_id: int, token_ids: list[int], temperature: float = 0.0, seed: int = 0) -> None:
        self.tokens[seq_id] = list(token_ids)
        self.computed[seq_id] = 0
        self.tables[seq_id] = []
        self.pending.append(
            NewSequence(seq_id, list(token_ids), [], 0, SamplingParams(temperature=temperature), seed)
        )

    def free_seq(self, seq_id: int) -> None:
        self.free.extend(self.tables.pop(seq_id))
        del self.tokens[seq_id], self.computed[seq_id]

    def step(self, schedule: dict[int, int], freed: list[int] | None = None) -> StepOutput:
        new_blocks = []
        for seq_id, n in schedule.items():
            need = -(-(self.computed[seq_id] + n) // BLOCK_SIZE) - len(self.tables[seq_id])
            if need > 0:
                blocks = [self.free.pop() for _ in range(need)]
                self.tables[seq_id].extend(blocks)
                new_blocks.append((seq_id, blocks))
        # The sequences that compute up to all their tokens sample (the scheduler's rule).
        sampling = [s for s, n in schedule.items() if self.computed[s] + n == len(self.tokens[s])]
        plan = StepPlan(
            self.step_id,
            freed or [],
            self.pending,
            new_blocks,
            list(schedule),
            list(schedule.values()),
            sampling,
        )
        self.step_id += 1
        self.pending = []
        self._rows = []
        out = self.runner.execute(plan)
        for seq_id, n in schedule.items():
            self.computed[seq_id] += n
        assert len(self._rows) == len(out.seq_ids)
        for seq_id, token, row in zip(out.seq_ids, out.token_ids, self._rows, strict=True):
            assert self.computed[seq_id] == len(self.tokens[seq_id])
            self.records.append((seq_id, len(self.tokens[seq_id]) - 1, row))
            self.tokens[seq_id].append(token)
        return out


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def _assert_logits_match_hf(
    driver: Driver, hf_model: LlamaForCausalLM, seq_tokens: dict[int, list[int]]
) -> None:
    with torch.no_grad():
        hf_logits = {
            s: hf_model(torch.tensor([t], device=hf_model.device)).logits[0].cpu()
            for s, t in seq_tokens.items()
        }  # [L, V]
    assert driver.records
    for seq_id, index, row in driver.records:
        diff = (row.cpu() - hf_logits[seq_id][index]).abs().max().item()
        assert diff < 1e-3, f"sequence {seq_id} token {index}: max abs logits diff {diff}"


def test_batched_prefill_then_decode_matches_transformers(tiny_model_dir: Path, hf_model) -> None:
    runner = make_runner(tiny_model_dir)
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    lengths = {0: 5, 1: 37, 2: 16, 3: 1, 4: 23}
    for seq_id, n in lengths.items():
        driver.add(seq_id, _random_prompt(rng, n, runner.vocab_size))
    out = driver.step(dict(lengths))
    assert out.seq_ids == list(lengths)
    for _ in range(6):
        driver.step(dict.fromkeys(lengths, 1))
    final = dict(driver.tokens)
    assert all(len(final[s]) == n + 7 for s, n in lengths.items())
    _assert_logits_match_hf(driver, hf_model, final)


def test_chunked_prefill_mixed_with_decodes_matches_transformers(tiny_model_dir: Path, hf_model) -> None:
    runner = make_runner(tiny_model_dir)
    driver = Driver(runner, seed=2)
    rng = random.Random(2)
    driver.add(0, _random_prompt(rng, 12, runner.vocab_size))
    driver.step({0: 12})
    driver.add(1, _random_prompt(rng, 45, runner.vocab_size))
    # The long prompt is split 20 + 25 (neither a block multiple) while sequence 0 decodes beside it.
    first = driver.step({1: 20, 0: 1})
    assert first.seq_ids == [0], "a partly prefilled sequence must not sample"
    second = driver.step({0: 1, 1: 25})
    assert second.seq_ids == [0, 1]
    for _ in range(4):
        driver.step({1: 1, 0: 1})
    _assert_logits_match_hf(driver, hf_model, dict(driver.tokens))


def test_greedy_tokens_match_transformers_generate(tiny_model_dir: Path, hf_model) -> None:
    runner = make_runner(tiny_model_dir)
    driver = Driver(runner, seed=3)
    rng = random.Random(3)
    prompts = {i: _random_prompt(rng, n, runner.vocab_size) for i, n in enumerate([3, 19, 33])}
    for seq_id, prompt in prompts.items():
        driver.add(seq_id, prompt)
    driver.step({s: len(p) for s, p in prompts.items()})
    for _ in range(11):
        driver.step(dict.fromkeys(prompts, 1))
    for seq_id, prompt in prompts.items():
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
        hf_new = hf[0, len(prompt) :].tolist()
        ours = driver.tokens[seq_id][len(prompt) :]
        assert len(hf_new) >= 1
        assert ours[: len(hf_new)] == hf_new  # generate may stop early at an EOS token; we do not


def test_recompute_after_preemption_draws_the_same_seeded_tokens(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    rng = random.Random(4)
    prompt = _random_prompt(rng, 9, runner.vocab_size)
    straight = Driver(runner, seed=4)
    straight.add(0, prompt, temperature=1.0, seed=77)
    straight.step({0: 9})
    for _ in range(7):
        straight.step({0: 1})
    expected = straight.tokens[0]

    # Same sequence, batched with another one, preempted after three tokens and recomputed under a new id.
    driver = Driver(runner, seed=5)
    driver.add(1, prompt, temperature=1.0, seed=77)
    driver.add(2, _random_prompt(rng, 30, runner.vocab_size), temperature=1.0, seed=3)
    driver.step({2: 30, 1: 9}, freed=[0])
    for _ in range(2):
        driver.step({1: 1, 2: 1})
    resumed = list(driver.tokens[1])
    driver.free_seq(1)
    driver.add(3, resumed, temperature=1.0, seed=77)
    driver.step({3: len(resumed)}, freed=[1])
    for _ in range(4):
        driver.step({3: 1})
    assert driver.tokens[3] == expected
    assert len(set(expected[9:])) > 1


def test_plans_that_contradict_the_worker_state_raise(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, num_kv_blocks=8)
    assert runner.execute(StepPlan(0, [], [], [], [], [], [])).seq_ids == []
    with pytest.raises(PlanError, match="unknown"):
        runner.execute(StepPlan(1, [], [], [], [42], [1], []))
    with pytest.raises(PlanError, match="unknown"):
        runner.execute(StepPlan(2, [], [], [(42, [0])], [], [], []))
    with pytest.raises(PlanError, match="unknown"):
        runner.execute(StepPlan(3, [42], [], [], [], [], []))
    short = NewSequence(7, list(range(1, 20)), [3], 0, SamplingParams(temperature=0.0), 0)
    with pytest.raises(PlanError, match="block table"):
        runner.execute(StepPlan(4, [], [short], [], [7], [19], []))
    with pytest.raises(PlanError, match="knows"):
        runner.execute(StepPlan(5, [], [], [(7, [4])], [7], [20], []))
    with pytest.raises(PlanError, match="outside the KV pool"):
        runner.execute(StepPlan(6, [], [], [(7, [8])], [], [], []))
