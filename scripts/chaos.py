"""Kills and stops each process of a supervised stack under load and measures how the rest copes.

The stack is the README's: `honcho start` on the Procfile, every process under `common.supervisor`, on
127.0.0.1 ports of its own. For each process (worker, scheduler, api) and signal (SIGKILL; SIGSTOP for the
worker), with requests streaming, it measures:
  - error_s: from the signal to the in-flight streams' error event (worker, scheduler), or, for the api, to
    the scheduler having aborted the dead api's requests and freed every KV block;
  - health_503_s: from the signal to /health answering 503 (not for the api: it is the one answering);
  - back_s: from the signal to a new request being served again.
A SIGTERM to honcho then measures the graceful stop: the short requests in flight finish, every process
exits 0 (honcho given as long to wait for them as the drain may take).

    python scripts/chaos.py --out docs/results/chaos-cpu.json    # prints a table; tests/chaos use it too
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.client import EngineClient  # noqa: E402
from scripts._servers import ROOT, WAIT_S, Honcho  # noqa: E402

LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}


@dataclass
class Stream:
    """One streamed completion read on a thread, with the time each event arrived."""

    events: list[tuple[float, dict | str]] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.finished = threading.Event()

    def first_error_at(self) -> float | None:
        return next((t for t, e in self.events if isinstance(e, dict) and "error" in e), None)

    @property
    def ended_with_done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    @property
    def completed(self) -> bool:
        """It ran to its end (a finish reason, no error event) and closed with [DONE]."""
        reasons = [
            c.get("finish_reason")
            for _, e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
        ]
        return self.ended_with_done and self.first_error_at() is None and any(reasons)

    @property
    def num_tokens(self) -> int:
        return sum(1 for _, e in self.events if isinstance(e, dict) and "choices" in e)


class Stack(Honcho):
    """The README's stack (scripts/_servers.Honcho) with what the measurements need: the processes' pids,
    streams read on threads, and the scheduler's own view of the KV pool."""

    def __init__(self, model_dir: Path, log_path: Path, **settings: object) -> None:
        # honcho kills what still runs 5 s after it signals (its KILL_WAIT): on a loaded machine that cut
        # streams the drain would let finish; the stop is bounded by the drain instead
        super().__init__(
            model_dir, log_path, kill_wait_s=2 * float(settings.get("shutdown_timeout_s", 30.0)), **settings
        )
        self._client: EngineClient | None = None

    def pid(self, name: str) -> int:
        """The pid of the running `python -m NAME` (not its supervisor)."""
        for proc in psutil.Process(self.honcho.pid).children(recursive=True):
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            if cmd[-2:] == ["-m", f"pagedserve.{name}"] and proc.status() != psutil.STATUS_ZOMBIE:
                return proc.pid
        raise LookupError(f"no running {name} process:\n{self.logs()[-3000:]}")

    def serves(self) -> bool:
        try:
            status, body = self.post({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}, timeout=10)
        except OSError:
            return False
        return status == 200 and body["usage"]["completion_tokens"] == 4

    def wait_serving(self, timeout: float = 180.0) -> float:
        return self.wait_until("serving", lambda: self.get("/health") == 200 and self.serves(), timeout, 0.2)

    def stream(self, body: dict = LONG_STREAM) -> Stream:
        """Starts a streamed request on a thread; returns once its first token arrived."""
        stream = Stream()

        def read() -> None:
            req = urllib.request.Request(
                self.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=WAIT_S) as r:
                    for line in r:
                        if line.startswith(b"data: "):
                            data = line[6:].strip()
                            event = "[DONE]" if data == b"[DONE]" else json.loads(data)
                            stream.events.append((time.monotonic(), event))
            except BaseException as e:  # noqa: BLE001 (recorded for the caller to judge)
                stream.error = e
            finally:
                stream.finished.set()

        threading.Thread(target=read, daemon=True).start()
        self.wait_until("a first token", lambda: stream.num_tokens > 0 or stream.finished.is_set())
        return stream

    def kv_idle(self) -> bool:
        """The scheduler reports no running request and no used KV block (asked over ZeroMQ, not the api)."""
        if self._client is None:  # one connection for every poll; it reconnects to a restarted scheduler
            self._client = EngineClient(self.scheduler_address, detokenize=False, info_timeout=1.0)
        try:
            text = self._client.info(timeout=1.0).metrics_text
        except TimeoutError:
            return False
        values = dict(line.split()[:2] for line in text.splitlines() if line and not line.startswith("#"))
        if "pagedserve_kv_blocks_used" not in values:
            return False  # no worker yet
        used, running = values["pagedserve_kv_blocks_used"], values["pagedserve_requests_running"]
        return float(used) == 0 and float(running) == 0

    def stop(self, timeout: float = 20.0) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return super().stop(timeout)


def _watch_health(stack: Stack, stop: threading.Event, seen: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        seen.append((time.monotonic(), stack.get("/health", timeout=1.0)))
        time.sleep(0.05)


def measure_kill(stack: Stack, name: str, sig: signal.Signals = signal.SIGKILL) -> dict[str, object]:
    """Signals process `name` with two streams in flight; returns the times (s) from the signal on.
    health_503_s is None when /health never said 503 (service came back before a poll could see it)."""
    streams = [stack.stream() for _ in range(2)]
    pid = stack.pid(name)
    health: list[tuple[float, int]] = []
    stop_polling = threading.Event()
    poller = threading.Thread(target=_watch_health, args=(stack, stop_polling, health), daemon=True)
    t0 = time.monotonic()
    os.kill(pid, sig)
    if name != "api":  # the api is the one that answers /health
        poller.start()
    result: dict[str, object] = {"process": name, "signal": sig.name}
    try:
        if name == "api":  # its streams die with it; the scheduler must free what they held
            result["error_s"] = stack.wait_until("the dead api's requests freed", stack.kv_idle) - t0
        else:
            stack.wait_until("error events", lambda: all(s.finished.is_set() for s in streams))
            for s in streams:
                ok = s.first_error_at() is not None and s.ended_with_done
                assert ok, f"a stream ended without an error event and [DONE]: {s.events[-3:]}"
            result["error_s"] = max(s.first_error_at() for s in streams) - t0  # type: ignore[type-var]
    finally:
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)  # it was declared dead: told to reset, it announces itself again
    result["back_s"] = stack.wait_serving() - t0
    stop_polling.set()
    if poller.is_alive():
        poller.join()
        result["health_503_s"] = next((t - t0 for t, status in health if status == 503), None)
    stack.wait_until("KV blocks all free", stack.kv_idle)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def measure_graceful_stop(stack: Stack) -> dict[str, object]:
    """SIGTERM to honcho while short streams run: they finish whole, then every process exits. (honcho's
    own exit code is 128 + SIGTERM whatever its processes did: the processes' codes come from their
    supervisors' `stopped` lines.)"""
    body = {**LONG_STREAM, "max_tokens": 16}
    streams = [stack.stream(body) for _ in range(2)]
    t0 = time.monotonic()
    stack.honcho.send_signal(signal.SIGTERM)
    honcho_code = stack.honcho.wait(stack.kill_wait_s + WAIT_S)  # a bound: honcho kills by its kill wait
    for s in streams:
        s.finished.wait(WAIT_S)
    codes = {}
    for line in stack.logs().splitlines():
        if '"event": "stopped"' in line and '"process": "supervisor"' in line:
            entry = json.loads(line[line.index("{") :])
            codes[entry["child"]] = entry["exit_code"]
    return {
        "process": "all (honcho)",
        "signal": "SIGTERM",
        "stopped_s": round(time.monotonic() - t0, 2),
        "exit_code": codes,
        "honcho_exit_code": honcho_code,
        "streams_completed": sum(s.completed for s in streams),
        "streams": len(streams),
    }


def _ttft(stack: Stack, body: dict) -> float:
    """Seconds from sending a streamed request to its first token."""
    t0 = time.monotonic()
    stream = stack.stream({**body, "stream": True})
    assert stream.num_tokens > 0, stream.events
    return stream.events[0][0] - t0


def measure_fair_ttft(stack: Stack, repeats: int = 5) -> dict[str, object]:
    """The time to first token of a 4-token request alone, and beside a request of as many sequences as the
    api allows (2 prompts x n=128), which alone would fill every seat the stack has (max_num_seqs)."""
    small = {"prompt": "Hi there", "max_tokens": 4, "ignore_eos": True}
    alone = sorted(_ttft(stack, small) for _ in range(repeats))
    big = {"prompt": ["A long story", "Another one"], "n": 128, "max_tokens": 400, "ignore_eos": True}
    stack.stream({**big, "stream": True})
    beside = sorted(_ttft(stack, small) for _ in range(repeats))
    stack.wait_until("the big request's end", stack.kv_idle, timeout=600)
    return {
        "ttft_alone_median_s": round(alone[len(alone) // 2], 3),
        "ttft_beside_median_s": round(beside[len(beside) // 2], 3),
        "ttft_beside_max_s": round(beside[-1], 3),
        "repeats": repeats,
    }


def measure_slow_reader(stack: Stack, seconds: float = 60.0, every_s: float = 5.0) -> dict[str, object]:
    """A client that sends a streamed n=128 request and then reads nothing: the api's and the scheduler's
    memory over time, and whether the request was ended (its KV freed)."""
    import socket

    body = json.dumps({"prompt": "Tell me", "n": 128, "max_tokens": 2000, "ignore_eos": True, "stream": True})
    api, scheduler = psutil.Process(stack.pid("api")), psutil.Process(stack.pid("scheduler"))
    samples = [(0.0, api.memory_info().rss >> 20, scheduler.memory_info().rss >> 20)]
    sock = socket.create_connection(("127.0.0.1", stack.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the api feels it at once
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    t0 = time.monotonic()
    freed_at = None
    try:
        while time.monotonic() - t0 < seconds:
            time.sleep(every_s)
            at = round(time.monotonic() - t0, 1)
            samples.append((at, api.memory_info().rss >> 20, scheduler.memory_info().rss >> 20))
            if freed_at is None and stack.kv_idle():
                freed_at = at
    finally:
        sock.close()
    return {"rss_mib_over_time": samples, "request_ended_by_s": freed_at}


def measure_wire_storm(stack: Stack, examples: int = 10_000, seed: int = 0) -> dict[str, object]:
    """Sends `examples` hostile messages of each kind of scripts/fuzz_wire.py (random frames, random msgpack
    under every type byte, a field of the wrong type) to the scheduler's two sockets, holding the cluster
    key, while a stream runs; then checks that no process died and that service and the KV pool are whole."""
    import zmq
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from pagedserve.common.config import default_cluster_key_file
    from pagedserve.common.security import load_cluster_key, secure_client
    from pagedserve.common.socket_limits import Receiver, max_message_bytes
    from scripts.fuzz_wire import KINDS

    key = load_cluster_key(stack.env.get("PAGEDSERVE_CLUSTER_KEY_FILE", default_cluster_key_file()))
    ctx = zmq.Context()
    socks = []
    for address in (stack.scheduler_address, stack.env["PAGEDSERVE_WORKER_ADDRESS"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, key, max_message_bytes(Receiver.CLIENT))
        sock.connect(address)
        socks.append(sock)
    pids = {name: stack.pid(name) for name in ("scheduler", "worker", "api")}
    stream = stack.stream()
    sent = 0
    for name in ("random frames", "random msgpack under every type byte", "wrong field type"):
        strategy = KINDS[name][0]

        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @hypothesis_seed(seed)
        @given(strategy)
        def send(frames: list[bytes]) -> None:
            nonlocal sent
            if frames:
                socks[sent % 2].send_multipart(frames)
                sent += 1

        send()
    stream.finished.wait(WAIT_S)
    for sock in socks:
        sock.close()
    ctx.term()
    serves = stack.serves()
    stack.wait_until("KV blocks all free", stack.kv_idle)
    restarted = [name for name, pid in pids.items() if stack.pid(name) != pid]
    return {
        "sent": sent,
        "restarted": restarted,
        "stream_completed": stream.completed,
        "serves_after": serves,
    }


def run_all(model_dir: Path, log_dir: Path) -> list[dict[str, object]]:
    stack = Stack(model_dir, log_dir / "honcho.log", **CHAOS_SETTINGS)
    try:
        stack.wait_serving()
        rows = [
            measure_kill(stack, "worker"),
            measure_kill(stack, "scheduler"),
            measure_kill(stack, "api"),
            measure_kill(stack, "worker", signal.SIGSTOP),
        ]
        rows.append(measure_graceful_stop(stack))
        return rows
    finally:
        stack.stop()


# Heartbeats fast enough that a stopped worker is found within seconds on a loaded 2-core machine; a drain
# budget that the short streams of measure_graceful_stop never outlast, however loaded the machine (a
# bound, not a wait: the processes exit as soon as their streams end).
CHAOS_SETTINGS: dict[str, object] = {
    "num_kv_blocks": 256,
    "max_num_seqs": 8,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 2.0,
    "shutdown_timeout_s": 60.0,
}


def _table(rows: list[dict[str, object]]) -> Iterator[str]:
    keys = ["process", "signal", "error_s", "health_503_s", "back_s", "stopped_s", "exit_code"]
    yield "| " + " | ".join(keys) + " |"
    yield "|" + "---|" * len(keys)
    for row in rows:
        yield "| " + " | ".join(str(row.get(k, "")) for k in keys) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models/tiny-llama")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-chaos"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-kills", action="store_true", help="only the --also measurements")
    parser.add_argument("--also", nargs="*", default=[], choices=["fair-ttft", "slow-reader", "wire-storm"])
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {}
    if not args.no_kills:
        result["kills"] = run_all(args.model, args.log_dir)
        print("\n".join(_table(result["kills"])))  # type: ignore[arg-type]
    if args.also:
        stack = Stack(args.model, args.log_dir / "honcho-load.log", **{**CHAOS_SETTINGS, "max_num_seqs": 64})
        try:
            stack.wait_serving()
            if "fair-ttft" in args.also:
                result["fair_ttft"] = measure_fair_ttft(stack)
                print("fair TTFT:", result["fair_ttft"])
            if "wire-storm" in args.also:
                result["wire_storm"] = measure_wire_storm(stack)
                print("wire storm:", result["wire_storm"])
            if "slow-reader" in args.also:
                result["slow_reader"] = measure_slow_reader(stack)
                print("slow reader:", result["slow_reader"])
        finally:
            stack.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
