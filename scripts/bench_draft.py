"""What drafting costs: median time of one `DraftModelProposer.propose` call in the steady state (each
sequence's tokens grown by the accepted drafts and the target's token since the last call), per batch size.

    python scripts/bench_draft.py --model /tmp/m1b --draft /tmp/m1b-draft [--k 4] [--batches 1,4,16]
        [--context 512] [--enforce-eager] [--chain on|off|both] [--out draft.json]

A call is then one decode step that catches up on the target's token, k - 1 drafting steps and one that
writes the last draft's KV (worker/spec/draft_model.py): with CUDA graphs (unless --enforce-eager) one replay
of the draft chain (worker/spec/draft_graphs.py), or with `--chain off` one decode graph replay a step
(`both`: each way in turn; `chained`: the share of calls that ran the chain). The time includes the host's
work and the one copy of the drafts back. Speculation pays when this plus the target's verification step
(k + 1 tokens a sequence) is well under the accepted tokens' worth of plain decode steps: compare with the
target's decode step time at the same batch. With graphs it prints what capturing them took (seconds, and
the chain's device memory).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagedserve.common.config import WorkerConfig  # noqa: E402
from pagedserve.common.speculative import SpeculativeConfig  # noqa: E402
from pagedserve.worker.spec.draft_model import DraftModelProposer  # noqa: E402
from pagedserve.worker.spec.proposer import ProposeRow  # noqa: E402
from scripts._bench import format_table, run_record, time_repeats, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the target checkpoint (its max_model_len and tokenizer)")
    p.add_argument("--draft", required=True, help="the draft checkpoint")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=512, help="tokens of each sequence before the first call")
    p.add_argument("--accepted", type=int, default=-1, help="drafts accepted per call; -1: all")
    p.add_argument("--repeat", type=int, default=10, help="timed repeats of --number calls")
    p.add_argument("--number", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the draft")
    p.add_argument(
        "--chain", choices=("on", "off", "both"), default="on",
        help="steady-state calls as one graph replay (on: as the engine runs them), step by step, or both",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="where to write the results as JSON")
    return p.parse_args(argv)


def bench(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """The runs, and what capturing the draft's graphs took (empty without graphs)."""
    batches = [int(b) for b in args.batches.split(",")]
    calls = (args.repeat + 1) * args.number + 1  # the prefill, the warm-up, the timed ones
    max_len = args.context + calls * (args.k + 1) + args.k + 16
    cfg = WorkerConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=max_len,
        max_num_seqs=max(batches), enforce_eager=args.enforce_eager, swap_space=0,
    )  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=args.k, model=args.draft)
    dtype = getattr(torch, cfg.resolved_dtype)
    proposer = DraftModelProposer(
        cfg, spec, cfg.resolved_device, dtype, max_prefill_tokens=max_len * max(batches)
    )
    proposer.allocate_kv(max(batches) * -(-max_len // cfg.block_size))
    sync = torch.cuda.synchronize if proposer.device.type == "cuda" else None
    vocab = proposer.model_config.vocab_size
    rng = random.Random(0)
    results = []
    chain = proposer.chain
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.chain]
    for batch, chained in [(b, c) for b in batches for c in modes]:
        proposer.chain = chain if chained else None
        before = proposer.num_chain_replays
        seqs = {i: [rng.randrange(vocab) for _ in range(args.context)] for i in range(batch)}
        counts = [0, 0]  # calls, drafts

        def call(seqs: dict[int, list[int]] = seqs, counts: list[int] = counts) -> None:
            rows = [ProposeRow(seq_id, tokens, args.k) for seq_id, tokens in seqs.items()]
            for tokens, drafts in zip(seqs.values(), proposer.propose(rows), strict=True):
                accepted = len(drafts) if args.accepted < 0 else min(args.accepted, len(drafts))
                tokens += drafts[:accepted] + [rng.randrange(vocab)]
                counts[1] += len(drafts)
            counts[0] += 1

        call()  # the prompts' prefill
        counts[:] = [0, 0]
        timing = time_repeats(call, args.repeat, args.number, sync)
        for seq_id in seqs:
            proposer.free(seq_id)
        results.append(
            {
                "batch": batch, "k": args.k, "propose_ms": timing.median * 1e3,
                "p90_ms": timing.quantile(0.9) * 1e3, "spread": timing.spread,
                "drafted_per_call": counts[1] / counts[0] / batch,
                "chained": (proposer.num_chain_replays - before) / counts[0],
            }
        )  # fmt: skip
    proposer.chain = chain
    capture = {}
    if proposer.graphs is not None and chain is not None:
        capture = {
            "decode_graphs_s": round(proposer.graphs.capture_time_s, 3),
            "chain_graphs_s": round(chain.capture_time_s, 3),
            "chain_graphs_mib": round(chain.capture_bytes / 2**20, 1),
        }
    return results, capture


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results, capture = bench(args)
    graphs = "eager" if args.enforce_eager or args.device == "cpu" else "CUDA graphs"
    print(f"draft {args.draft}, k={args.k}, context {args.context}, {graphs}, on {args.device}")
    if capture:
        print(", ".join(f"{key} {value}" for key, value in capture.items()))
    cells = [
        [str(r["batch"]), f"{r['propose_ms']:.3f}", f"{r['p90_ms']:.3f}", f"{r['drafted_per_call']:.2f}"]
        + [f"{r['chained']:.2f}"]
        for r in results
    ]
    print(format_table(["batch", "propose ms (median)", "p90 ms", "drafts per row", "chained"], cells))
    write_json(args.out, {"runs": results, "capture": capture, "record": run_record(__file__, argv)})
    return results


if __name__ == "__main__":
    main()
