"""The client's liveness check judges the scheduler only for the time it owed an answer, and never for time
during which the client itself was not running.

Defects guarded:
- False 503s after a quiet spell: after 10 s or more with no traffic the first requests failed with 503
  "the scheduler did not answer for N s" within a second, although the scheduler was idle and healthy (the
  silence was measured from the last message heard, long before the request was sent).
- A client (the api) whose own process or event loop did not run for longer than the timeout (stopped,
  starved, blocked) failed every request in flight on resume, blaming the scheduler for its own pause.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagedserve.client import AsyncEngineClient
from pagedserve.common.messages import SamplingParams
from pagedserve.common.security import load_cluster_key
from scripts._servers import ROOT
from tests.chaos.answering_scheduler import AnsweringScheduler

TIMEOUT_S = 1.0  # the client's liveness timeout here (10 s by default)
PARAMS = SamplingParams(max_tokens=1)


def _client(address: str, key_file: Path, timeout_s: float = TIMEOUT_S) -> AsyncEngineClient:
    return AsyncEngineClient(
        address, detokenize=False, cluster_key_file=str(key_file), liveness_timeout_s=timeout_s
    )


def test_requests_sent_after_a_quiet_spell_longer_than_the_timeout_are_served(tmp_path: Path):
    key_file = tmp_path / "key"
    # Answers take 0.6 s: within the timeout, but later than the keep-alive's next look (every 0.25 s).
    with AnsweringScheduler(load_cluster_key(key_file), answer_after_s=0.6) as scheduler:

        async def scenario() -> None:
            async with _client(scheduler.address, key_file) as client:
                [first] = await client.submit([1, 2, 3], PARAMS)
                assert (await asyncio.wait_for(first.result(), 10)).outputs[0].token_ids == [7]
                for quiet_s, batch in ((1.6, 1), (2.2, 4)):  # each quiet spell longer than the timeout
                    await asyncio.sleep(quiet_s)
                    handles = await client.submit([[1, 2, 3]] * batch, PARAMS)
                    results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 10)
                    assert [r.outputs[0].finish_reason for r in results] == ["length"] * batch

        asyncio.run(scenario())


def test_a_client_whose_loop_stalled_longer_than_the_timeout_keeps_its_requests(tmp_path: Path):
    key_file = tmp_path / "key"
    timeout_s = 2.0
    with AnsweringScheduler(load_cluster_key(key_file), answer_after_s=7.0) as scheduler:

        async def scenario() -> None:
            async with _client(scheduler.address, key_file, timeout_s) as client:
                [handle] = await client.submit([1, 2, 3], PARAMS)
                await asyncio.sleep(0.3)
                assert scheduler.submitted_at, "the request did not reach the scheduler"
                time.sleep(3 * timeout_s)  # this process's loop does not run (as under SIGSTOP)
                # The scheduler answers 7 s after the request: after the stall, within a timeout of it.
                result = await asyncio.wait_for(handle.result(), 10)
                assert result.outputs[0].finish_reason == "length"

        asyncio.run(scenario())


CLIENT_PROCESS = """
import asyncio, sys
from pagedserve.client import AsyncEngineClient
from pagedserve.common.messages import SamplingParams

async def main() -> None:
    address, key_file, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    async with AsyncEngineClient(
        address, detokenize=False, cluster_key_file=key_file, liveness_timeout_s=timeout_s
    ) as client:
        [handle] = await client.submit([1, 2, 3], SamplingParams(max_tokens=1))
        print("submitted", flush=True)
        try:
            result = await asyncio.wait_for(handle.result(), 30)
            print("finished", result.outputs[0].finish_reason, flush=True)
        except Exception as e:
            print("failed", type(e).__name__, e, flush=True)

asyncio.run(main())
"""


def _words(proc: subprocess.Popen) -> queue.Queue[str]:
    """The client process's words as it says them (its log lines, on the same stdout, left out)."""
    words: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(("submitted", "finished", "failed")):
                words.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return words


def test_a_client_process_stopped_longer_than_the_timeout_keeps_its_requests(tmp_path: Path):
    key_file = tmp_path / "key"
    timeout_s = 2.0
    with AnsweringScheduler(load_cluster_key(key_file), answer_after_s=3 * timeout_s + 1.5) as scheduler:
        argv = [sys.executable, "-c", CLIENT_PROCESS, scheduler.address, str(key_file), str(timeout_s)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        words = _words(proc)
        try:
            assert words.get(timeout=60) == "submitted"
            proc.send_signal(signal.SIGSTOP)
            time.sleep(3 * timeout_s)
            proc.send_signal(signal.SIGCONT)
            assert words.get(timeout=20) == "finished length"
        finally:
            proc.kill()
            proc.wait()
