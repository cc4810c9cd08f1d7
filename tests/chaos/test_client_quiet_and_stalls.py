"""The client's liveness check judges the scheduler only for the time it owed an answer, and never for time
during which the client itself was not running.

Defects guarded:
- False 503s after a quiet spell: after 10 s or more with no traffic the first requests failed with 503
  "the scheduler did not answer for N s" within a second, although the scheduler was idle and healthy (the
  silence was measured from the last message heard, long before the request was sent).
- A client (the api) whose own event loop did not run for longer than the timeout (stopped, starved,
  blocked) failed every request in flight on resume, the scheduler's answers still unread.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from client import AsyncEngineClient
from common.messages import SamplingParams
from common.security import load_cluster_key
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
