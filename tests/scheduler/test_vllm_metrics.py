"""vLLM's metric families beside ours, read back with prometheus_client's own text parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.common.messages import FinishReason
from pagedserve.scheduler.metrics import VLLM_E2E_BUCKETS, VLLM_ITL_BUCKETS, VLLM_TTFT_BUCKETS
from tests.scheduler.conftest import OWNER, make_harness

LABELS = {"model_name": "tiny", "engine": "2"}


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    (value,) = [
        s.value
        for s in families[name].samples
        if s.name == (sample or name) and s.labels == {**LABELS, **labels}
    ]
    return value


def test_vllm_families_carry_their_labels_and_agree_with_ours():
    h = make_harness(num_blocks=32, block_size=4, model_name="tiny", data_parallel_rank=2)
    system = list(range(50, 62))  # three shared blocks
    assert h.submit("r0", system + [0, 1], max_tokens=3) is None
    h.run()  # its blocks are cached: the next three hit them
    for i in range(1, 4):
        assert h.submit(f"r{i}", system + [i, i + 1], max_tokens=3 + i) is None
    for _ in range(2):
        h.step()
    families = _families(h.scheduler.metrics_text())
    running = _value(families, "vllm:num_requests_running")
    waiting = _value(families, "vllm:num_requests_waiting")
    assert running >= 1 and running + waiting == 3
    usage = _value(families, "vllm:kv_cache_usage_perc")
    assert _value(families, "vllm:gpu_cache_usage_perc") == usage  # the older name
    assert usage == h.scheduler.block_manager.num_used_blocks / 32 and 0 < usage <= 1
    h.record(h.scheduler.abort(OWNER, "r3"))  # a client goes away
    h.run()
    text = h.scheduler.metrics_text()
    families = _families(text)
    assert families["vllm:num_requests_running"].type == "gauge"
    assert (
        _value(families, "vllm:num_requests_running") == 0
        and _value(families, "vllm:kv_cache_usage_perc") == 0
    )
    prompt_tokens = 4 * 14
    assert _value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_tokens
    generated = sum(len(t) for t in h.tokens.values())
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    queries = _value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = _value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert families["vllm:prefix_cache_hits"].type == "counter" and 0 < hits < queries
    assert f"pagedserve_prefix_cache_queries_total {queries}\n" in text  # the same count as ours
    success = {
        reason: _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort")
    }
    assert success == {"stop": 0, "length": 3, "abort": 1}
    assert list(h.finish.values()).count(FinishReason.LENGTH) == 3
    started = sum(1 for tokens in h.tokens.values() if tokens)  # sequences that had a first token
    for name, buckets, count in (
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS, started),
        ("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS, generated - started),
        ("vllm:time_per_output_token_seconds", VLLM_ITL_BUCKETS, generated - started),
        ("vllm:e2e_request_latency_seconds", VLLM_E2E_BUCKETS, 4),
    ):
        family = families[name]
        assert family.type == "histogram"
        bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
        assert bounds == [*buckets, float("inf")]
        assert _value(families, name, name + "_count") == count > 0
    # ours are still there, unchanged
    assert "pagedserve_requests_finished_total 4.0" in text and "pagedserve_kv_blocks_total 32.0" in text
