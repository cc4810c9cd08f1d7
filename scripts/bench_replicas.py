"""Replicas behind vllm-router: the prefix-cache hit rate of a multi-turn chat workload under kv_aware,
one replica serving everything, and round robin (and the same greedy replies from all three).

    python scripts/bench_replicas.py --model /tmp/tiny-llama --device cpu --json-out replicas.json

Starts `pagedserve serve MODEL --data-parallel-size N` (vllm-router, kv_aware, on a free port), then runs
the workload three times, each under its own `cache_salt` so that no run finds another's blocks:
- `kv_aware`: through the launcher's router;
- `one replica`: straight to replica 0, which serves everything;
- `round_robin`: through a second vllm-router, `--policy round_robin`, in front of the same replicas.
The workload: --conversations conversations x --turns turns, all sharing a system prompt; each turn sends
every conversation's next question, in one fixed order, with the replies so far. With N = 3 and 19
conversations, round robin moves every conversation to another replica at every turn, so that only the
system prompt is found in the cache; ideal placement finds each conversation's whole history.
The hit rate is the replicas' vllm:prefix_cache_hits / vllm:prefix_cache_queries summed, over the run.
Requests go one at a time: sent together, kv_aware would weigh the replicas' queues against their caches
(its cost is both), and round robin's placement would follow the order of their arrival.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from scripts._bench import format_table, run_record, write_json  # noqa: E402
from scripts._servers import ROOT, free_port  # noqa: E402

ROUTER = Path(sys.executable).parent / "vllm-router"
SYSTEM = "You are a terse assistant for a paged KV cache server."  # two blocks with the template's tokens
TOPICS = "blocks tables hashes pages queues tokens caches batches".split()
Replies = list[list[str]]


def wait_for(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.2)


def http_status(url: str) -> int:
    """The status of GET `url`; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Stack:
    """`pagedserve serve MODEL --data-parallel-size N` in its own session, on free ports, logging to `log`."""

    def __init__(self, model_dir: Path, log: Path, replicas: int, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replicas = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(replicas)]
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        argv = [
            sys.executable, "-m", "pagedserve", "serve", str(model_dir), "--port", str(self.port),
            "--data-parallel-size", str(replicas), "--cluster-key-file", str(log.parent / "key"), *args,
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = 180.0) -> None:
        def up(url: str) -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited:\n{self.text()[-3000:]}")
            return http_status(url) == 200

        for url in self.replicas:
            wait_for(f"{url} healthy", lambda url=url: up(url + "/health"), timeout)
        wait_for("the router", lambda: up(self.url + "/v1/models"), timeout)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))

    def supervisors(self) -> dict[str, int]:
        """The launcher's supervisors by name (api.0, scheduler.0, ..., router): their pids."""
        line = next(line for line in self.text().splitlines() if '"supervisors"' in line)
        return json.loads(line[line.index("{") :])["supervisors"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class RoundRobinRouter:
    """vllm-router --policy round_robin in front of `replicas`, on a free port."""

    def __init__(self, replicas: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(ROUTER), "--host", "127.0.0.1", "--port", self.url.rpartition(":")[2],
                 "--prometheus-port", str(free_port()), "--worker-urls", *replicas,
                 "--policy", "round_robin"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for("the round-robin router", lambda: http_status(self.url + "/v1/models") == 200, 60)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(10)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0
    )


def question(conversation: int, turn: int) -> str:
    topic, other = TOPICS[(conversation + turn) % len(TOPICS)], TOPICS[conversation % len(TOPICS)]
    return (
        f"Conversation {conversation}, question {turn}: how does the server handle {topic} when the cache "
        f"is full and {other} arrive?"
    )


def run_workload(
    chat: openai.OpenAI,
    salt: str,
    conversations: int = 19,
    turns: int = 4,
    before_turn: Callable[[int], None] = lambda turn: None,
) -> Replies:
    """The multi-turn workload through `chat`, one request at a time; its greedy replies by conversation,
    then turn. A failed request raises."""
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(conversations)]

    def ask(c: int) -> str:
        reply = chat.chat.completions.create(
            model="tiny-llama", messages=histories[c], max_tokens=4, temperature=0, timeout=120,
            extra_body={"cache_salt": salt, "ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].message.content or ""

    replies: Replies = [[] for _ in range(conversations)]
    for turn in range(turns):
        before_turn(turn)
        for c in range(conversations):
            histories[c].append({"role": "user", "content": question(c, turn)})
            text = ask(c)
            histories[c].append({"role": "assistant", "content": text})
            replies[c].append(text)
    return replies


def prefix_cache_counts(urls: list[str]) -> tuple[float, float]:
    """vllm:prefix_cache_hits and vllm:prefix_cache_queries summed over `urls`' /metrics."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                hits += s.value if s.name == "vllm:prefix_cache_hits_total" else 0.0
                queries += s.value if s.name == "vllm:prefix_cache_queries_total" else 0.0
    return hits, queries


def hit_rate(replicas: list[str], run: Callable[[], Replies]) -> tuple[float, Replies]:
    """The summed prefix-cache hit rate of the replicas over `run`, and its replies."""
    hits, queries = prefix_cache_counts(replicas)
    replies = run()
    hits_after, queries_after = prefix_cache_counts(replicas)
    return (hits_after - hits) / (queries_after - queries), replies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint whose served name is tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=19)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=512, help="per replica")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_replicas"))
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(
        args.model, args.log_dir / "serve.log", args.replicas, "--device", args.device,
        "--num-kv-blocks", str(args.num_kv_blocks), "--served-model-name", "tiny-llama",
    )  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    replies: dict[str, Replies] = {}
    try:
        stack.wait_ready()
        shape = {"conversations": args.conversations, "turns": args.turns}

        def measure(name: str, url: str) -> None:
            start = time.perf_counter()
            chat = client(url)
            rate, replies[name] = hit_rate(stack.replicas, lambda: run_workload(chat, name, **shape))
            results[name] = {"hit_rate": rate, "seconds": time.perf_counter() - start}

        measure("kv_aware", stack.url)
        measure("one replica", stack.replicas[0])
        rr = RoundRobinRouter(stack.replicas, args.log_dir / "round_robin.log")
        try:
            measure("round_robin", rr.url)
        finally:
            rr.stop()
    finally:
        stack.stop()
    same = replies["kv_aware"] == replies["one replica"] == replies["round_robin"]
    rows = [[name, f"{r['hit_rate']:.3f}", f"{r['seconds']:.1f}"] for name, r in results.items()]
    print(format_table(["placement", "prefix-cache hit rate", "seconds"], rows))
    print(f"greedy replies identical across placements: {same}")
    write_json(
        args.json_out, {**run_record("bench_replicas", argv), "results": results, "same_replies": same}
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
