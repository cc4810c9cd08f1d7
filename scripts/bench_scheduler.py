"""Times the scheduler core alone (schedule + update per step) with a fake worker that only samples.

    python scripts/bench_scheduler.py [--requests 10000] [--steps 1500] [--json-out FILE]

10k requests (prompts of 32-1024 random tokens, outputs of 16-512, fixed seed) are queued at once; for each
of 64, 256 and 1024 running sequences (max_num_seqs) the scheduler runs until that many are running, then
`--steps` steps are timed. The pool is large enough that nothing is preempted, so the numbers are the steady
decode-heavy path a GPU step waits on. A last run at 256 with `--kv-policy reserved` shows the KV waste of
reserving whole lengths up front, against paging's partly filled last blocks. The last line reads
`256 running: <microseconds> us/step`.

`--viewer`: the cost of a /dashboard viewer instead. At 256 running sequences, blocks of 50 steps alternate
without and with a viewer that asks for a KV snapshot every step through the server's `SnapshotCache` (so
one is built at most every `--snapshot-interval-s`, and no more than 1% of the time, as in the scheduler
process); a step's time includes the
snapshot built in it (CPU time). Prints the mean step time of each, the overhead, a snapshot's median build
time and its size on the wire. `--viewer-blocks` sets the pool (65,536 blocks; the other runs' 1M-block pool
is a stress case for the map: 150k cached blocks after a while).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

from pagedserve.common.messages import (  # noqa: E402
    SamplingParams,
    StepOutput,
    StepPlan,
    SubmitRequest,
    encode,  # noqa: E402
)
from pagedserve.scheduler.scheduler import Scheduler  # noqa: E402
from pagedserve.scheduler.settings import SchedulerSettings  # noqa: E402
from pagedserve.scheduler.snapshot import SnapshotCache  # noqa: E402
from scripts._bench import format_table, write_json  # noqa: E402


class SamplingOnlyWorker:
    """Returns a token for every sequence the plan says samples, and for its fork children."""

    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput(plan.step_id, [], [], [])
        for seq_id in plan.sampling_seq_ids:
            out.seq_ids.append(seq_id)
            out.token_ids.append(seq_id % 1000)
            out.logprobs.append(None)
        for fork in plan.forks:
            out.seq_ids.append(fork.child_seq_id)
            out.token_ids.append(7)
            out.logprobs.append(None)
        return out


def filled_scheduler(
    max_num_seqs: int, num_requests: int, seed: int, kv_policy: str = "paged", num_blocks: int = 1 << 20
) -> Scheduler:
    """A scheduler with `num_requests` queued and `max_num_seqs` of them running."""
    rng = random.Random(seed)
    settings = SchedulerSettings(
        num_kv_blocks=num_blocks,
        block_size=16,
        max_model_len=4096,
        vocab_size=32000,
        eos_token_ids=(),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(8192, 2 * max_num_seqs),
        kv_policy=kv_policy,
        max_waiting_seqs=num_requests,  # every request queued at once
    )
    scheduler = Scheduler(settings)
    worker = SamplingOnlyWorker()
    for i in range(num_requests):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(32, 1024))]
        params = SamplingParams(max_tokens=rng.randint(16, 512), ignore_eos=True, seed=i)
        assert scheduler.add_request(b"bench", SubmitRequest(str(i), prompt, params)) is None

    warmup = 0
    while scheduler.num_running_seqs < max_num_seqs:  # fill the batch first
        scheduler.update(worker.execute(scheduler.schedule()))
        warmup += 1
        assert warmup < 100_000
    return scheduler


def run(max_num_seqs: int, num_requests: int, steps: int, seed: int, kv_policy: str = "paged") -> dict:
    scheduler = filled_scheduler(max_num_seqs, num_requests, seed, kv_policy)
    worker = SamplingOnlyWorker()
    step_us, seqs, waste = [], [], []
    for i in range(steps):
        if i % 50 == 0:  # KV waste: slots allocated but holding no token (not timed)
            usage = scheduler.kv_usage()
            waste.append(1 - usage.slots_used / usage.slots_allocated)
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        output = worker.execute(plan)  # not timed: the GPU's share
        t2 = time.perf_counter()
        scheduler.update(output)
        t3 = time.perf_counter()
        step_us.append(((t1 - t0) + (t3 - t2)) * 1e6)
        seqs.append(len(plan.scheduled_seq_ids))
    median = statistics.median(step_us)
    return {
        "kv_policy": kv_policy,
        "max_num_seqs": max_num_seqs,
        "kv_waste": statistics.fmean(waste),
        "median_us_per_step": median,
        "p90_us_per_step": statistics.quantiles(step_us, n=10)[-1],
        "mean_scheduled_seqs": statistics.fmean(seqs),
        "us_per_scheduled_seq": median / statistics.median(seqs),
        "steps": steps,
    }


def run_viewer(
    num_requests: int, steps: int, seed: int, interval_s: float, num_blocks: int, running: int = 256
) -> dict:
    """Step time with and without a dashboard viewer, in alternating blocks of 50 steps. Times are the
    process's CPU time (the scheduler is a CPU process; on a shared machine wall time measures the
    neighbours too)."""
    scheduler = filled_scheduler(running, num_requests, seed, num_blocks=num_blocks)
    worker = SamplingOnlyWorker()
    # The viewer's clock runs only during watched steps, so snapshots come as often per watched step as
    # they would with the viewer attached all along (a wall clock would crowd them into half the steps).
    watched_time = [0.0]
    clock = time.process_time
    cache = SnapshotCache(interval_s, clock=lambda: watched_time[0], timer=clock)
    times: dict[bool, list[float]] = {False: [], True: []}
    builds: list[float] = []
    for i in range(steps):
        watched = (i // 50) % 2 == 1
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        output = worker.execute(plan)  # not timed: the GPU's share
        t2 = clock()
        scheduler.update(output)
        if watched:
            built = cache.num_built
            cache.get(scheduler.kv_snapshot, 4096)
            if cache.num_built > built:
                builds.append(cache.last_build_s)
        t4 = clock()
        times[watched].append(((t1 - t0) + (t4 - t2)) * 1e6)
        if watched:
            watched_time[0] += (t1 - t0) + (t4 - t2)
    snapshot = scheduler.kv_snapshot(4096)
    without, with_viewer = statistics.fmean(times[False]), statistics.fmean(times[True])
    return {
        "running": running,
        "steps": steps,
        "snapshot_interval_s": interval_s,
        "num_blocks": num_blocks,
        "mean_us_per_step_without": without,
        "mean_us_per_step_with_viewer": with_viewer,
        "overhead": with_viewer / without - 1,
        "snapshots_built": cache.num_built,
        "snapshot_build_us": statistics.median(builds) * 1e6 if builds else 0.0,
        "snapshot_bytes": len(encode(snapshot)[1]),
        "blocks_used": snapshot.blocks_used,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--viewer", action="store_true", help="measure a /dashboard viewer's cost at 256 running")
    p.add_argument("--snapshot-interval-s", type=float, default=0.5)
    p.add_argument("--viewer-blocks", type=int, default=1 << 16, help="the pool with --viewer (blocks of 16)")
    args = p.parse_args(argv)
    if args.viewer:
        row = run_viewer(args.requests, args.steps, args.seed, args.snapshot_interval_s, args.viewer_blocks)
        columns = [
            "blocks",
            "running",
            "us/step without",
            "us/step with viewer",
            "overhead",
            "snapshots",
            "build us",
            "bytes",
        ]
        cells = [[
            str(row["num_blocks"]), str(row["running"]), f"{row['mean_us_per_step_without']:.0f}",
            f"{row['mean_us_per_step_with_viewer']:.0f}", f"{row['overhead']:+.2%}",
            str(row["snapshots_built"]), f"{row['snapshot_build_us']:.0f}", str(row["snapshot_bytes"]),
        ]]  # fmt: skip
        print(format_table(columns, cells))
        write_json(args.json_out, [row])
        print(f"viewer overhead at 256 running: {row['overhead']:+.2%}")
        return
    rows = [run(r, args.requests, args.steps, args.seed) for r in args.running]
    rows.append(run(256, args.requests, args.steps, args.seed, kv_policy="reserved"))
    columns = ["policy", "running", "us/step p50", "us/step p90", "seqs/step", "us/seq", "KV waste"]
    cells = [
        [row["kv_policy"], str(row["max_num_seqs"]), f"{row['median_us_per_step']:.0f}"]
        + [f"{row['p90_us_per_step']:.0f}", f"{row['mean_scheduled_seqs']:.1f}"]
        + [f"{row['us_per_scheduled_seq']:.2f}", f"{row['kv_waste']:.1%}"]
        for row in rows
    ]
    print(format_table(columns, cells))
    write_json(args.json_out, rows)
    for row in rows:
        if row["max_num_seqs"] == 256 and row["kv_policy"] == "paged":
            print(f"256 running: {row['median_us_per_step']:.0f} us/step")


if __name__ == "__main__":
    main()
