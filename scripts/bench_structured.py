"""Per-step host cost of structured output with xgrammar and llguidance: filling the next-token bitmasks of a
batch of constrained sequences and advancing their matchers by one token, plus each grammar's compile time.

    python scripts/bench_structured.py [--batches 1,32,256] [--steps 32] [--vocab 128000] [--out s.json]
    python scripts/bench_structured.py --worker-path [--batches 256,512,900] [--grammar-threads 1,2] \
        [--before b767555] [--stagger 64] [--profile]

Two tokenizers: the tiny test checkpoint's (scripts/make_model.py, 4096 tokens) and a byte-level BPE trained
here on synthetic text (random words over a mixed alphabet, plus the Python standard library's modules) to
`--vocab` tokens, cached under `--tokenizer-dir`. The tokens each step accepts are drawn at random among
those the mask allows (that draw is not timed), so the matchers walk through real, growing JSON documents.

`--worker-path` times the worker's own per-step call instead (worker/structured.py
`StructuredOutputs.bitmask`: advance every constrained row's matcher by its new token, fill the bitmasks,
pack them for the device) with the GPU workload's schema (scripts/bench_schema.json) on every row, logits
128,256 wide (the GPU benchmark's Llama-3.2-1B shape: its logits are wider than the 4,096-token test
tokenizer), for each `--grammar-threads` (0: the worker's default from the CPU count). Rows whose document is
complete keep drawing EOS, as the throughput benchmark's `ignore_eos` requests do. `--before REV` runs the
same measurements first on the tree of git revision REV (its worker/, common/, kernels/; this script's
harness), in a subprocess, and the table puts each configuration's before and after side by side.
`--stagger K` first feeds each row a random number of tokens below K, untimed, so that the timed steps see
rows at every depth of their documents (the workload mid-run) rather than all at their start. `--profile`
splits each step of the one-thread runs (timers around xgrammar's two batched calls, medians over the
steps): xgrammar's accept (`worker.grammar_batch.batch_accept`, or `batch_accept_token` and its Python
wrapper in a tree before it), its mask fill (`batch_fill_next_token_bitmask`), and the rest (this
repository's Python per row, the stop rows, the packing; on the CPU there is no copy to a device).
`--structured-module` names another module with the same class to compare against.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts._bench import format_table, run_record, write_json  # noqa: E402

SCHEMAS: dict[str, dict[str, Any] | None] = {
    "json_object": None,  # any JSON object
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        },
        "required": ["id", "kind", "point", "code"],
        "additionalProperties": False,
    },
}


def build_large_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A byte-level BPE of about `vocab_size` tokens as a transformers fast tokenizer, trained once."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (directory / "tokenizer.json").exists():
        return directory
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-éàüßøçñ"
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 12))) for _ in range(400_000)]

    def corpus():
        for _ in range(200):
            yield " ".join(rng.choices(words, k=20_000))
        for path in sorted(Path(__import__("sysconfig").get_paths()["stdlib"]).glob("*.py")):
            yield path.read_text(errors="replace")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])
    fast.save_pretrained(directory)
    return directory


def _allowed_token(bitmask_row: np.ndarray, vocab_size: int, rng: np.random.Generator, stop: int) -> int:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    if len(allowed) > 1:
        allowed = allowed[allowed != stop]
    return int(rng.choice(allowed)) if len(allowed) else stop


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()
        self.vocab_size = vocab_size

    def compile(self, schema: dict | None) -> Any:
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    @staticmethod
    def done(matcher: Any) -> bool:
        return matcher.is_terminated()


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self, schema: dict | None) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"})
        )
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # the lexer is built here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            m.consume_token(t)

    @staticmethod
    def done(matcher: Any) -> bool:
        return matcher.is_stopped() or matcher.is_error()


def bench_steps(engine: Any, compiled: Any, batch: int, steps: int, eos: int) -> tuple[float, float]:
    """Median seconds of one batched mask fill and of one batched advance, over `steps` steps."""
    rng = np.random.default_rng(0)
    matchers = engine.matchers(compiled, batch)
    bitmask = engine.bitmask(batch)
    fills, accepts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        fills.append(time.perf_counter() - t0)
        masks = bitmask.numpy()
        tokens = [_allowed_token(masks[i], engine.vocab_size, rng, eos) for i in range(batch)]
        t0 = time.perf_counter()
        engine.accept(matchers, tokens)
        accepts.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):  # a finished document starts over
            if engine.done(m) or tokens[i] == eos:
                matchers[i] = engine.matchers(compiled, 1)[0]
    return float(np.median(fills)), float(np.median(accepts))


def _draw(words: np.ndarray, rng: np.random.Generator, eos: int) -> int:
    """A token among those a bitmask row ([W] uint32) allows, not EOS unless EOS alone is allowed."""
    nonzero = np.flatnonzero(words)
    for _ in range(4):
        w = int(rng.choice(nonzero))
        bits = np.flatnonzero(np.unpackbits(words[w : w + 1].view(np.uint8), bitorder="little"))
        token = 32 * w + int(rng.choice(bits))
        if token != eos:
            return token
    return token


def bench_worker_path(
    module: str,
    tokenizer_dir: str,
    batch: int,
    steps: int,
    threads: int,
    vocab_size: int = 128256,
    stagger: int = 0,
    profile: bool = False,
) -> dict[str, float]:
    """Per-step milliseconds of `StructuredOutputs.bitmask` over `batch` rows constrained by
    bench_schema.json (median, 90th percentile, CPU time of all threads), the share of rows finished, and
    with `profile` the medians' split: xgrammar's accept, its fill, the rest."""
    import importlib

    from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
    from pagedserve.worker.sequences import SeqState

    cls = importlib.import_module(module).StructuredOutputs
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    try:
        structured = cls(tokenizer_dir, vocab_size, [eos], grammar_threads=threads or None)
    except TypeError:  # an older module: no thread count
        structured = cls(tokenizer_dir, vocab_size, [eos])
    spec = (Path(__file__).parent / "bench_schema.json").read_text()
    params = SamplingParams(max_tokens=4096, structured=StructuredOutput("json_schema", spec=spec))
    seqs = [SeqState([1, 2, 3], 3, params, i, -1, i, prompt_len=3) for i in range(batch)]
    seq_ids = list(range(batch))
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    lead = rng.integers(0, stagger, batch) if stagger else np.zeros(batch, dtype=np.int64)
    for step in range(int(lead.max(initial=0))):  # untimed: row i first gains lead[i] tokens
        rows = [i for i in range(batch) if lead[i] > step]
        mask = structured.bitmask(step, rows, [seqs[i] for i in rows], dict, cpu)
        words = mask.bitmask.numpy().view(np.uint32)
        for k, i in enumerate(rows):
            seqs[i].token_ids.append(_draw(words[k], rng, eos))
    first = int(lead.max(initial=0))
    times, cpu_times = [], []
    spent = {"accept": 0.0, "fill": 0.0}  # this step's seconds in each of xgrammar's batched calls
    splits: list[tuple[float, float]] = []
    for step in range(first, first + steps + 1):  # the first step may wait for the compile: not counted
        spent.update(accept=0.0, fill=0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        with _timing_xgrammar(spent) if profile else contextlib.nullcontext():
            mask = structured.bitmask(step, seq_ids, seqs, dict, cpu)
        times.append(time.perf_counter() - t0)
        splits.append((spent["accept"], spent["fill"]))
        cpu_times.append(time.process_time() - c0)  # every thread's: what a shared machine distorts less
        words = mask.bitmask.numpy().view(np.uint32)
        for i, seq in enumerate(seqs):
            seq.token_ids.append(_draw(words[i], rng, eos))
    done = sum(s.token_ids[-1] == eos for s in seqs)
    structured.close()
    t, c = np.array(times[1:]) * 1e3, np.array(cpu_times[1:]) * 1e3
    row = dict(
        median_ms=float(np.median(t)), p90_ms=float(np.percentile(t, 90)), cpu_median_ms=float(np.median(c)),
        finished=done / batch,
    )  # fmt: skip
    if profile:
        accept, fill = (np.array(column[1:]) * 1e3 for column in zip(*splits, strict=True))
        row.update(
            accept_ms=float(np.median(accept)), fill_ms=float(np.median(fill)),
            other_ms=float(np.median(t - accept - fill)),
        )  # fmt: skip
    return row


@contextlib.contextmanager
def _timing_xgrammar(spent: dict[str, float]):
    """Adds the seconds spent in xgrammar's batched accept and fill to `spent` while open (one thread). The
    accept is timed where the worker calls it: `worker.grammar_batch.batch_accept` since it calls xgrammar's
    core, the public `batch_accept_token` before."""
    import xgrammar as xgr

    from pagedserve.worker import grammar_batch

    cls = xgr.BatchGrammarMatcher
    fill = cls.batch_fill_next_token_bitmask
    if hasattr(grammar_batch, "batch_accept"):
        owner, name, wrap = grammar_batch, "batch_accept", lambda f: f
    else:  # (a tree before it: xgrammar's static method)
        owner, name, wrap = cls, "batch_accept_token", staticmethod
    original = owner.__dict__[name]  # put back as it was
    accept = getattr(owner, name)

    def timed_accept(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = accept(*args, **kwargs)
        spent["accept"] += time.perf_counter() - t0
        return out

    def timed_fill(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fill(self, *args, **kwargs)
        spent["fill"] += time.perf_counter() - t0
        return out

    setattr(owner, name, wrap(timed_accept))
    cls.batch_fill_next_token_bitmask = timed_fill
    try:
        yield
    finally:
        setattr(owner, name, original)
        cls.batch_fill_next_token_bitmask = fill


def worker_main(args: argparse.Namespace) -> None:
    from scripts.make_model import make_model

    tiny = make_model(Path("/tmp/pagedserve-bench-tiny-llama"), preset="tiny", seed=0)
    large = build_large_tokenizer(Path(args.tokenizer_dir) / str(args.vocab), args.vocab)
    rows = _before_rows(args) if args.before else []
    version = args.version or "working tree"
    for tok_name, tok_dir in (("tiny 4k", tiny), ("128k BPE", large)):
        for batch in [int(b) for b in args.batches.split(",")]:
            for threads in [int(t) for t in args.grammar_threads.split(",")]:
                config = (args.structured_module, str(tok_dir), batch, args.steps, threads)
                r = bench_worker_path(*config, stagger=args.stagger, profile=args.profile and threads == 1)
                row = dict(tokenizer=tok_name, batch=batch, threads=threads, version=version, **r)
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = ["tokenizer", "batch", "threads", "version", "median_ms", "p90_ms", "cpu_median_ms"]
    columns += ["accept_ms", "fill_ms", "other_ms", "finished"] if args.profile else ["finished"]
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    print(format_table(columns, cells))
    if args.before:
        print(format_table(*_speedups(rows)))
    write_json(args.out, {"runs": rows, "record": run_record(__file__)})


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _before_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same sweep on the tree of `args.before`, in a subprocess whose worker/, common/ and kernels/
    are that tree's (imported before this script's harness, which comes from the working tree)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="bench-structured-before-") as tree:
        archive = subprocess.run(["git", "archive", args.before], cwd=root, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        out = Path(tree) / "before.json"
        argv = ["--worker-path", "--batches", args.batches, "--grammar-threads", args.grammar_threads]
        argv += [
            "--steps",
            str(args.steps),
            "--vocab",
            str(args.vocab),
            "--tokenizer-dir",
            args.tokenizer_dir,
        ]
        argv += ["--stagger", str(args.stagger), "--structured-module", args.structured_module]
        argv += ["--out", str(out), "--version", f"before ({args.before})"] + ["--profile"] * args.profile
        driver = (
            "import runpy, sys; tree, script = sys.argv[1:3]; sys.path.insert(0, tree); "
            "import common, worker, kernels; sys.argv = [script, *sys.argv[3:]]; "
            "runpy.run_path(script, run_name='__main__')"
        )
        subprocess.run([sys.executable, "-c", driver, tree, __file__, *argv], check=True)
        return json.loads(out.read_text())["runs"]


def _speedups(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Each configuration's before and after medians (wall and CPU) and their ratio."""
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        side = "before" if str(r["version"]).startswith("before") else "after"
        by_key.setdefault((r["tokenizer"], r["batch"], r["threads"]), {})[side] = r
    columns = ["tokenizer", "batch", "threads", "before_ms", "after_ms", "x", "before_cpu_ms", "after_cpu_ms"]
    cells = []
    for (tok, batch, threads), pair in by_key.items():
        if "before" in pair and "after" in pair:
            b, a = pair["before"], pair["after"]
            ratio = f"{b['median_ms'] / a['median_ms']:.1f}"
            times = [_cell(b["median_ms"]), _cell(a["median_ms"]), ratio]
            cells.append(
                [tok, str(batch), str(threads), *times, _cell(b["cpu_median_ms"]), _cell(a["cpu_median_ms"])]
            )
    return columns, cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128000, help="the large tokenizer's target vocabulary")
    p.add_argument("--tokenizer-dir", default="/tmp/pagedserve-bench-tokenizer-128k")
    p.add_argument("--engines", default="xgrammar,llguidance")
    p.add_argument("--out", default=None)
    p.add_argument("--worker-path", action="store_true", help="time StructuredOutputs.bitmask per step")
    p.add_argument("--grammar-threads", default="1,2", help="--worker-path: thread counts, 0 the default")
    p.add_argument("--before", default=None, help="--worker-path: also measure this git revision's tree")
    p.add_argument("--version", default=None, help=argparse.SUPPRESS)  # the label of --before's rows
    p.add_argument("--stagger", type=int, default=0, help="--worker-path: rows start up to K tokens in")
    p.add_argument("--profile", action="store_true", help="--worker-path: split the one-thread runs")
    p.add_argument("--structured-module", default="pagedserve.worker.structured")
    args = p.parse_args()
    if args.worker_path:
        if args.batches == "1,32,256":
            args.batches = "256,512,900"
        worker_main(args)
        return
    from transformers import AutoTokenizer

    from scripts.make_model import make_model

    tokenizers: dict[str, Any] = {}
    tiny = make_model(Path("/tmp/pagedserve-bench-tiny-llama"), preset="tiny", seed=0)
    tokenizers["tiny"] = AutoTokenizer.from_pretrained(tiny)
    started = time.perf_counter()
    large = build_large_tokenizer(Path(args.tokenizer_dir) / str(args.vocab), args.vocab)
    print(f"large tokenizer ready in {time.perf_counter() - started:.1f} s", flush=True)
    tokenizers["large"] = AutoTokenizer.from_pretrained(large)
    engines: dict[str, Callable[..., Any]] = {"xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine}
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    for tok_name, tok in tokenizers.items():
        vocab_size = len(tok)
        eos = tok.eos_token_id
        for engine_name in args.engines.split(","):
            t0 = time.perf_counter()
            engine = engines[engine_name](tok, vocab_size, eos)
            setup_s = time.perf_counter() - t0
            for schema_name, schema in SCHEMAS.items():
                t0 = time.perf_counter()
                compiled = engine.compile(schema)
                compile_s = time.perf_counter() - t0
                for batch in batches:
                    fill_s, accept_s = bench_steps(engine, compiled, batch, args.steps, eos)
                    row = dict(
                        tokenizer=tok_name, vocab=vocab_size, engine=engine_name, schema=schema_name,
                        batch=batch, setup_ms=setup_s * 1e3, compile_ms=compile_s * 1e3,
                        fill_ms=fill_s * 1e3, accept_ms=accept_s * 1e3,
                    )  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    columns = ["tokenizer", "vocab", "engine", "schema", "batch", "setup_ms", "compile_ms", "fill_ms"]
    columns.append("accept_ms")
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    print(format_table(columns, cells))
    write_json(args.out, {"runs": rows, "record": run_record(__file__)})


if __name__ == "__main__":
    main()
