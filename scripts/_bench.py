"""What the benchmark scripts share: one table format, one JSON record, one way to time, one engine start-up.

    rows = [{"name": "a", "us": 1.5}]
    print(format_table(["name", "us"], [[r["name"], f"{r['us']:.1f}"] for r in rows]))
    t = time_repeats(lambda: work(), repeat=15, number=100)  # seconds per call: t.median, t.spread
    # the record: date, GPU, git commit, command line
    write_json(path, {"runs": rows, "record": run_record(__file__, argv)})

A comparison that must show its noise brackets the candidate between baseline runs (`bracket_order`,
`Bracketed`); `scripts/bench_throughput.py --compare` is the example. The servers' processes start through
`scripts/_servers.py`; `engine_session` adds the wait for the worker and the log tails on failure. Scripts
that build a worker in their own process take its settings as the worker's own flags (`add_worker_flags`,
`worker_config`), so a field of `common/config.py`'s WorkerConfig is declared once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

from pagedserve.client import AsyncEngineClient
from pagedserve.common.config import WorkerConfig, choices_of
from pagedserve.common.messages import InfoReply
from scripts._servers import ROOT, Engine, start_engine


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns under their headers (every benchmark script's table)."""
    cells = [list(columns), *map(list, rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def cell(value: object, fmt: str = "") -> str:
    """A table cell: "-" for a missing value, else the value formatted."""
    return "-" if value is None else format(value, fmt)


def git_commit(root: Path = ROOT) -> str:
    """The short commit of `root`'s checkout, with "+" when its tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not commit:
        return "unknown"
    return commit + "+" if dirty else commit


def gpu_name() -> str | None:
    """The first CUDA device's name; None without one (or without torch)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_record(script: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and when a result was measured: UTC date, GPU, git commit, and the command line that ran
    `script` (a path; its `__file__`) with `argv` (default: this process's arguments)."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    args = sys.argv[1:] if argv is None else argv
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "commit": git_commit(),
        "command": shlex.join(["python", str(shown), *args]),
    }


def write_json(path: str | Path | None, results: object) -> None:
    """Writes `results` as indented JSON to `path` (nothing when None), making its folder. A report that is
    a dict carries its `run_record` under "record"; a bare list of rows is written as it is."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing: the median and how far the repeats spread around it."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 means the repeats lie within 5% of the median's size."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0

    def quantile(self, q: float) -> float:
        """The q-th quantile (0-1) with linear interpolation between order statistics."""
        ordered = sorted(self.samples)
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def time_repeats(
    fn: Callable[[], object], repeat: int, number: int = 1, sync: Callable[[], object] | None = None
) -> Timing:
    """Seconds per call of `fn`, `repeat` times over `number` calls each, after one unmeasured call (which
    compiles, allocates and warms caches). `sync` (e.g. torch.cuda.synchronize) runs before each clock
    read."""
    sync = sync or (lambda: None)
    fn()
    samples = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / number)
    return Timing(tuple(samples))


def bracket_order(repeats: int) -> list[str]:
    """The order of a bracketed comparison: the baseline before and after every candidate run,
    A B A for one repeat, A B A B A for two."""
    return ["baseline", *(["candidate", "baseline"] * repeats)]


@dataclass(frozen=True)
class Bracketed:
    """A candidate measured between baseline runs of the same call (`bracket_order`); higher is better.
    The baselines' own spread says how much of the candidate's ratio is noise."""

    values: tuple[tuple[str, float], ...]  # (role, value) in the order they ran

    def of(self, role: str) -> list[float]:
        return [v for r, v in self.values if r == role]

    @property
    def ratio(self) -> float:
        """The candidates' mean over the baselines' mean."""
        return statistics.fmean(self.of("candidate")) / statistics.fmean(self.of("baseline"))

    @property
    def baseline_spread(self) -> float:
        """(max - min) / mean of the baseline runs: a ratio within this of 1 is not a difference."""
        base = self.of("baseline")
        return (max(base) - min(base)) / statistics.fmean(base)

    def ratios(self) -> list[float]:
        """Each candidate run over the mean of the two baseline runs beside it."""
        values = [v for _, v in self.values]
        return [values[i] / ((values[i - 1] + values[i + 1]) / 2) for i in range(1, len(values), 2)]

    def summary(self) -> dict[str, Any]:
        return {
            "order": [r for r, _ in self.values],
            "values": [v for _, v in self.values],
            "ratio": round(self.ratio, 4),
            "bracket_ratios": [round(r, 4) for r in self.ratios()],
            "baseline_spread": round(self.baseline_spread, 4),
        }


DEFAULT_MODEL = ROOT / "models" / "tiny-llama"


def resolve_model(model: str | None) -> Path:
    """`--model`, or the tiny preset at DEFAULT_MODEL (made on first use)."""
    if model is not None:
        return Path(model)
    from scripts.make_model import make_model

    return make_model(DEFAULT_MODEL, preset="tiny", seed=0)  # does nothing when it is there already


def add_engine_flags(p: argparse.ArgumentParser, sample_interval: float = 1.0) -> None:
    """The flags of every benchmark that starts the engine's processes (`engine_settings` reads them)."""
    p.add_argument(
        "--model", default=None, help=f"checkpoint directory; default: {DEFAULT_MODEL} (made if missing)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--num-kv-blocks", type=int, default=0, help="KV pool of every run; 0: the worker's default"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=0, help="0: the worker's default, which follows its KV pool"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--sample-interval", type=float, default=sample_interval, help="seconds between metrics samples"
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the worker")
    p.add_argument("--log-dir", default=None, help="the processes' logs go here; default: a temp dir")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--speculative-config",
        default="",
        help="the worker's speculative decoding config (vLLM's JSON shape, docs/speculative.md); '': off",
    )


def engine_settings(args: argparse.Namespace, **settings: object) -> dict[str, object]:
    """PAGEDSERVE_* settings of `add_engine_flags`'s flags, with `settings` over them. Logs at warning:
    per-request log lines would cost the processes time."""
    keys = ("device", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens")
    spec = {"speculative_config": args.speculative_config} if getattr(args, "speculative_config", "") else {}
    return {k: getattr(args, k) for k in keys} | {"log_level": "warning"} | spec | settings


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # max_tokens with ignore_eos: exactly this many tokens come back


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The length ranges of `make_workload`'s requests."""
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=512)


def check_workload_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if not 1 <= args.min_output_len <= args.max_output_len:
        p.error("need 1 <= --min-output-len <= --max-output-len")


def make_workload(
    args: argparse.Namespace, vocab_size: int, num_requests: int | None = None, seed: int | None = None
) -> list[BenchRequest]:
    """`--num-requests` requests of the flags' length ranges, drawn from `--seed` (or as many / as seeded)."""
    rng = random.Random(args.seed if seed is None else seed)
    workload = []
    for _ in range(args.num_requests if num_requests is None else num_requests):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        output_len = rng.randint(args.min_output_len, args.max_output_len)
        workload.append(BenchRequest([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len))
    return workload


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of Prometheus text (`name value` lines)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class MetricsSampler:
    """Reads the scheduler's metrics every `interval` seconds until cancelled."""

    def __init__(self, client: AsyncEngineClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.samples: list[dict[str, float]] = []

    async def run(self) -> None:
        while True:
            try:
                info = await self.client.info(timeout=5.0)
                self.samples.append(parse_metrics(info.metrics_text))
            except TimeoutError:
                pass  # a busy scheduler: skip this sample
            await asyncio.sleep(self.interval)

    def mean_kv_waste(self) -> float | None:
        """1 - used / allocated KV slots, averaged over samples that had any allocated; None without one."""
        wastes = [
            1.0 - s["pagedserve_kv_slots_used"] / s["pagedserve_kv_slots_allocated"]
            for s in self.samples
            if s.get("pagedserve_kv_slots_allocated", 0) > 0
        ]
        return sum(wastes) / len(wastes) if wastes else None

    def peak(self, name: str) -> int:
        return int(max((s.get(name, 0) for s in self.samples), default=0))


async def read_metrics(client: AsyncEngineClient) -> dict[str, float]:
    """The scheduler's metrics now."""
    return parse_metrics((await client.info(timeout=10.0)).metrics_text)


async def wait_ready(client: AsyncEngineClient, engine: Engine, timeout_s: float) -> InfoReply:
    """Polls the scheduler until it reports the worker ready; raises with the worker's log tail when a
    process exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine.check_alive()
        try:
            info = await client.info(timeout=2.0)
            if info.ready:
                return info
        except TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker was not ready within {timeout_s:.0f} s:\n{engine.logs('worker')}")
        await asyncio.sleep(0.2)


@asynccontextmanager
async def engine_session(
    model_dir: Path,
    log_dir: Path,
    ready_timeout: float,
    processes: tuple[str, ...] = ("scheduler", "worker"),
    root: Path = ROOT,
    **settings: object,
) -> AsyncIterator[tuple[Engine, AsyncEngineClient, InfoReply]]:
    """Starts the engine's processes (`start_engine`, from the checkout at `root`), connects a client
    (no detokenizing) and waits until the worker is ready. On any failure inside, every process's log tail
    goes to stderr; the processes stop on the way out."""
    engine = start_engine(model_dir, log_dir, processes, root=root, **settings)
    try:
        async with AsyncEngineClient(engine.scheduler_address, detokenize=False) as client:
            yield engine, client, await wait_ready(client, engine, ready_timeout)
    except BaseException:
        for name in engine.procs:
            print(f"--- {name} log tail ---\n{engine.logs(name)}", file=sys.stderr)
        raise
    finally:
        engine.stop()


def add_worker_flags(
    parser: argparse.ArgumentParser, names: Sequence[str], required: Sequence[str] = (), **defaults: object
) -> None:
    """Flags for the named fields of WorkerConfig, spelled and typed as the worker's own (`max_num_seqs` ->
    `--max-num-seqs`; a boolean gets `--x` / `--no-x`). `defaults` replaces a field's default for this
    script; the names in `required` have none. The worker's PAGEDSERVE_* variables are not read: a
    benchmark's settings are its command line."""
    hints = get_type_hints(WorkerConfig)
    by_name = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    choices = choices_of(WorkerConfig)
    for name in names:
        # `bool | None` (unset: the worker decides) reads as bool; a Literal is a string of its choices
        tp = (
            str
            if name in choices
            else next((t for t in get_args(hints[name]) if t is not type(None)), hints[name])
        )
        default = defaults.get(name, by_name[name].default)
        flag = "--" + name.replace("_", "-")
        helptext = f"the worker's {flag} (common/config.py WorkerConfig.{name})"
        if name in required:
            parser.add_argument(flag, type=tp, required=True, choices=choices.get(name), help=helptext)
        elif tp is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{helptext}; default {default}",
            )
        else:
            parser.add_argument(
                flag,
                type=tp,
                default=default,
                choices=choices.get(name),
                help=f"{helptext}; default {default!r}",
            )


def worker_config(args: argparse.Namespace, names: Sequence[str], **settings: object) -> WorkerConfig:
    """The WorkerConfig of the flags `add_worker_flags(parser, names)` added, with `settings` over them."""
    return WorkerConfig(**({name: getattr(args, name) for name in names} | settings))


def in_process_scheduler(runner: Any, max_num_seqs: int, max_num_batched_tokens: int = 8192) -> Any:
    """A scheduler core (scheduler/scheduler.py) sized to `runner`'s KV pool and model, as the worker's
    announcement sizes the real one: for scripts that run the core and a ModelRunner in one process."""
    from pagedserve.scheduler.scheduler import Scheduler  # the CPU-only scripts need no scheduler
    from pagedserve.scheduler.settings import SchedulerSettings

    return Scheduler(
        SchedulerSettings(
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size,
            eos_token_ids=tuple(runner.eos_token_ids),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
