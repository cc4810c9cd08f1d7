"""The ZeroMQ client library against a fake scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pagedserve.client import (
    AsyncEngineClient,
    ClientClosed,
    EngineClient,
    RequestRejected,
    SequenceDelta,
)
from pagedserve.common.messages import AbortRequest, ErrorKind, SamplingParams
from tests.api.fake_scheduler import FakeScheduler
from tests.api.harness import BackgroundLoop

T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run_with_fake(
    test: Callable[[FakeScheduler], Awaitable[T]], timeout: float = 30.0, **fake_options: Any
) -> T:
    async def main() -> T:
        async with FakeScheduler(**fake_options) as fake:
            return await asyncio.wait_for(test(fake), timeout)

    return asyncio.run(main())


def expected_tokens(prompt: list[int], index: int, count: int) -> list[int]:
    return [prompt[(index + k) % len(prompt)] for k in range(count)]


def test_token_prompts_are_sent_as_given_and_all_sequences_finish() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            results = await client.generate([[5, 6, 7], [9]], SamplingParams(n=2, max_tokens=4))
        assert [s.prompt_token_ids for s in fake.submits()] == [[5, 6, 7], [9]]
        first, second = results
        assert [o.token_ids for o in first.outputs] == [[5, 6, 7, 5], [6, 7, 5, 6]]
        assert [o.finish_reason for o in first.outputs] == ["length", "length"]
        assert second.outputs[1].token_ids == [9, 9, 9, 9]
        assert first.num_prompt_tokens == 3 and first.num_output_tokens == 8
        assert first.outputs[0].text is None  # no tokenizer
        assert client.num_unfinished == 0

    run_with_fake(test)


def test_text_prompts_are_tokenized_and_deltas_carry_text(tokenizer: Any) -> None:
    prompt = "hello 日本語 world"

    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, tokenizer) as client:
            handle = await client.submit_one(prompt, SamplingParams(max_tokens=12))
            deltas = [d async for d in handle]
        ids = tokenizer(prompt)["input_ids"]
        assert handle.prompt_token_ids == ids  # BOS included, as a completion prompt
        out_ids = [t for d in deltas for t in d.token_ids]
        assert out_ids == expected_tokens(ids, 0, 12)
        assert "".join(d.text or "" for d in deltas) == tokenizer.decode(out_ids, skip_special_tokens=True)
        assert [d.num_output_tokens for d in deltas] == list(range(1, 13))
        assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])

    run_with_fake(test)


def test_tokenizer_comes_from_the_model_root_when_none_is_given(tiny_model_dir: Path) -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address) as client:
            [result] = await client.generate("abc", SamplingParams(max_tokens=3))
        assert result.outputs[0].text is not None
        assert fake.submits()[0].prompt_token_ids[0] == 4091  # the checkpoint's BOS

    run_with_fake(test, model_root=str(tiny_model_dir))


def test_stop_string_across_tokens_truncates_and_aborts_the_sequence(tokenizer: Any) -> None:
    # The fake echoes the prompt, so sequence 0 writes "one two three four..." and 1 starts a token later.
    prompt_ids = tokenizer.encode(" one two three four five six", add_special_tokens=False)
    params = SamplingParams(n=2, max_tokens=20, stop=("ee fo",))

    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, tokenizer) as client:
            handle = await client.submit_one(prompt_ids, params)
            deltas: list[SequenceDelta] = [d async for d in handle]
            await asyncio.sleep(0.05)  # late tokens the fake sends after the abort must be ignored
        for index in (0, 1):
            seq = [d for d in deltas if d.index == index]
            text = "".join(d.text or "" for d in seq)
            assert "ee fo" not in text and not any("fo" in (d.text or "") for d in seq)
            full = tokenizer.decode(expected_tokens(prompt_ids, index, 20))
            assert text == full[: full.index("ee fo")] and text.endswith("thr")
            assert seq[-1].finish_reason == "stop"
        aborts = [a for a in fake.aborts() if a.request_id == handle.request_id]
        assert sorted(a.index or 0 for a in aborts) == [0, 1]
        assert all(a.finish_reason == "stop" for a in aborts)

    run_with_fake(test, late_tokens_after_abort=2)


def test_stop_token_ids_and_logprobs_pass_through() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            params = SamplingParams(max_tokens=10, stop_token_ids=(30,), logprobs=2)
            [result] = await client.generate([[10, 20, 30, 40]], params)
        seq = result.outputs[0]
        assert seq.token_ids == [10, 20, 30] and seq.finish_reason == "stop"
        assert seq.logprobs is not None and [lp.top_token_ids for lp in seq.logprobs][0] == [10, 11]

    run_with_fake(test)


def test_scheduler_refusals_raise_from_the_handle() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            handle = await client.submit_one([1, 99999], SamplingParams(max_tokens=2))
            with pytest.raises(RequestRejected) as info:
                await handle.result()
            assert info.value.kind == ErrorKind.INVALID_REQUEST and "token ids" in info.value.message
            with pytest.raises(RequestRejected) as info:
                await client.submit_one([1], SamplingParams(n=0))  # refused before it is sent
            assert info.value.kind == ErrorKind.INVALID_REQUEST
            fake.ready = False
            with pytest.raises(RequestRejected) as info:
                await client.generate([[1, 2]], SamplingParams(max_tokens=2))
            assert info.value.kind == ErrorKind.UNAVAILABLE
            assert client.num_unfinished == 0

    run_with_fake(test)


def test_priority_and_cache_salt_travel_with_every_request() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            params = SamplingParams(max_tokens=1)
            await client.generate([[1, 2], [3]], params, priority=-2, cache_salt="team-a")
            await (await client.submit_one([4], params, priority=7)).result()
            await client.generate([[5]], params)
            for priority, cache_salt in ((True, ""), (1.5, ""), (2**63, ""), (0, 5)):
                with pytest.raises(RequestRejected) as info:
                    await client.submit_one([6], params, priority=priority, cache_salt=cache_salt)  # type: ignore[arg-type]
                assert info.value.kind == ErrorKind.INVALID_REQUEST
        sent = [(s.prompt_token_ids, s.priority, s.cache_salt) for s in fake.submits()]
        assert sent == [([1, 2], -2, "team-a"), ([3], -2, "team-a"), ([4], 7, ""), ([5], 0, "")]

    run_with_fake(test, scheduling_policy="priority")


def test_a_priority_under_fcfs_is_refused_by_the_scheduler() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            with pytest.raises(RequestRejected) as info:
                await (await client.submit_one([4], SamplingParams(max_tokens=1), priority=7)).result()
            assert info.value.kind == ErrorKind.INVALID_REQUEST
            assert "Priority scheduling is not enabled" in info.value.message
            await (await client.submit_one([4], SamplingParams(max_tokens=1), priority=0)).result()

    run_with_fake(test)


def test_abort_ends_the_request_and_tells_the_scheduler() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            handle = await client.submit_one([1, 2, 3], SamplingParams(n=2, max_tokens=200))
            first = await handle.__anext__()
            handle.abort()
            rest = [d async for d in handle]
            assert first.finish_reason is None
            assert sorted((d.index, d.finish_reason) for d in rest if d.finish_reason) == [
                (0, "abort"),
                (1, "abort"),
            ]
            await asyncio.sleep(0.05)
            assert fake.aborts() == [AbortRequest(handle.request_id, None, "abort")]
            assert fake.num_running == 0

    run_with_fake(test, step_delay=0.01)


def test_close_aborts_unfinished_requests() -> None:
    async def test(fake: FakeScheduler) -> None:
        client = AsyncEngineClient(fake.address, detokenize=False)
        handles = await client.submit([[1], [2], [3]], SamplingParams(max_tokens=200))
        await handles[0].__anext__()
        await client.close()
        with pytest.raises(ClientClosed):
            async for _ in handles[1]:
                pass
        for _ in range(100):
            if len(fake.aborts()) == 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(a.request_id for a in fake.aborts()) == sorted(h.request_id for h in handles)

    run_with_fake(test, step_delay=0.01)


def test_info_answers_and_times_out() -> None:
    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address) as client:
            info = await client.info()
            assert info.ready and info.vocab_size == 4096 and "pagedserve_requests_total" in info.metrics_text
            fake.answer_info = False
            with pytest.raises(TimeoutError):
                await client.info(timeout=0.2)

    run_with_fake(test)


def test_thousands_of_concurrent_requests_share_one_socket() -> None:
    prompts = [[i % 4000 + 1, i % 7 + 1] for i in range(2000)]

    async def test(fake: FakeScheduler) -> None:
        async with AsyncEngineClient(fake.address, detokenize=False) as client:
            results = await client.generate(prompts, SamplingParams(max_tokens=3))
        assert [r.outputs[0].token_ids for r in results] == [expected_tokens(p, 0, 3) for p in prompts]
        assert len({s.request_id for s in fake.submits()}) == len(prompts)

    run_with_fake(test, timeout=60)


def test_sync_client_streams_and_generates(tokenizer: Any) -> None:
    background = BackgroundLoop()
    fake = background.run(FakeScheduler(scheduling_policy="priority").start())
    try:
        with EngineClient(fake.address, tokenizer) as client:
            assert client.info().ready
            handle = client.submit_one("abc def", SamplingParams(max_tokens=5))
            deltas = list(handle)
            assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 5
            results = client.generate(["x", [7, 8]], SamplingParams(max_tokens=2), priority=3, cache_salt="s")
            assert results[1].outputs[0].token_ids == [7, 8]
            assert results[1].outputs[0].text == tokenizer.decode([7, 8])
            client.submit_one([9], SamplingParams(max_tokens=1), priority=-1).result()
            assert [(s.priority, s.cache_salt) for s in fake.submits()[-3:]] == [(3, "s"), (3, "s"), (-1, "")]
    finally:
        background.run(fake.stop())
        background.close()
