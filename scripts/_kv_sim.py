"""Records KV traces of the real scheduler core on a synthetic workload, without a model: for
scripts/kv_replay.py's `simulate`, which compares KV policies on the same workload and the same KV budget.

The core (scheduler/scheduler.py) runs as in the scheduler process, with `--kv-policy` as given: `paged`, or
`reserved-max` (the scheduler's own baseline mode: each sequence claims max_model_len slots at admission, as
a server that reserves the longest possible sequence). The worker is replaced by one that only samples: each
sequence generates its planned number of tokens and then EOS, the same for both policies (a plan per
seq_id; seq ids are handed out in arrival order, so the two runs give request i the same ids). Requests
arrive on a fixed schedule of steps. A step counts as `STEP_S` seconds of trace time, so that traces of
different policies line up by step; one snapshot is recorded every `every` steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pagedserve.common.kv_view import snapshot_json, trace_header
from pagedserve.common.messages import SamplingParams, StepOutput, StepPlan, SubmitRequest
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings

STEP_S = 0.02  # trace seconds per step
EOS = 2
VOCAB = 32000


@dataclass(frozen=True)
class SimRequest:
    arrival_step: int
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    output_lens: tuple[int, ...]  # what each of its n sequences generates before EOS


@dataclass(frozen=True)
class Workload:
    num_blocks: int = 768
    block_size: int = 16
    max_model_len: int = 1024
    num_requests: int = 96
    arrivals_per_step: float = 0.5
    seed: int = 0


def make_requests(w: Workload) -> list[SimRequest]:
    """Chat-like requests: a third share a system prompt; one in eight asks for n=4; each asks for up to
    512 tokens (max_tokens) and generates 16 to 300."""
    rng = random.Random(w.seed)
    system = [rng.randrange(3, VOCAB) for _ in range(96)]
    requests, step = [], 0
    for _ in range(w.num_requests):
        step += int(rng.expovariate(w.arrivals_per_step))
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(24, 200))]
        prompt = (system + own) if rng.random() < 1 / 3 else own
        n = 4 if rng.random() < 1 / 8 else 1
        lens = tuple(rng.randint(16, 300) for _ in range(n))
        requests.append(SimRequest(step, prompt, n, 512, lens))
    return requests


class PlannedLengthWorker:
    """Samples a token for each sequence the plan says, EOS once the sequence reached its planned length."""

    def __init__(self) -> None:
        self.planned: dict[int, int] = {}  # seq_id -> output tokens it generates
        self.generated: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput(plan.step_id, [], [], [])
        for new in plan.new_seqs:
            self.generated[new.seq_id] = new.num_output_tokens
        for fork in plan.forks:
            self.generated[fork.child_seq_id] = self.generated.get(fork.parent_seq_id, 0)
        sampling = list(plan.sampling_seq_ids) + [f.child_seq_id for f in plan.forks]
        for seq_id in sampling:
            count = self.generated.get(seq_id, 0) + 1
            self.generated[seq_id] = count
            out.seq_ids.append(seq_id)
            out.token_ids.append(EOS if count >= self.planned.get(seq_id, 1) else 3 + seq_id % 1000)
            out.logprobs.append(None)
        return out


def simulate(w: Workload, kv_policy: str, path: Path, every: int = 2, max_cells: int = 4096) -> int:
    """Runs the workload under `kv_policy` and writes its trace to `path`; returns the steps it took."""
    settings = SchedulerSettings(
        num_kv_blocks=w.num_blocks, block_size=w.block_size, max_model_len=w.max_model_len,
        vocab_size=VOCAB, eos_token_ids=(EOS,), max_num_seqs=64, max_num_batched_tokens=1024,
        kv_policy=kv_policy, preemption_mode="recompute",
    )  # fmt: skip
    step = [0]
    scheduler = Scheduler(settings, clock=lambda: step[0] * STEP_S)
    worker = PlannedLengthWorker()
    pending = make_requests(w)
    with path.open("wb") as f:
        f.write(trace_header(num_blocks=w.num_blocks, block_size=w.block_size, kv_policy=kv_policy,
                             simulated=True, step_s=STEP_S) + b"\n")  # fmt: skip
        next_seq_id = 0  # the core hands out seq ids in arrival order, n per request
        while pending or scheduler.has_work:
            while pending and pending[0].arrival_step <= step[0]:
                r = pending.pop(0)
                params = SamplingParams(max_tokens=r.max_tokens, n=r.n, seed=next_seq_id)
                submit = SubmitRequest(f"req-{next_seq_id}", r.prompt_token_ids, params)
                error = scheduler.add_request(b"sim", submit)
                assert error is None, error
                for length in r.output_lens:
                    worker.planned[next_seq_id] = length
                    next_seq_id += 1
            if scheduler.has_work:
                scheduler.update(worker.execute(scheduler.schedule()))
            if step[0] % every == 0:
                snapshot = scheduler.kv_snapshot(max_cells)
                f.write(snapshot_json(msgspec.structs.replace(snapshot, time_s=step[0] * STEP_S)) + b"\n")
            step[0] += 1
            assert step[0] < 1_000_000, "the simulation made no progress"
    return step[0]
