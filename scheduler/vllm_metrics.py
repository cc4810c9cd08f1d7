"""vLLM's metric names, types, labels and buckets (`vllm/v1/metrics/loggers.py`), beside our own, so that
tools written for vLLM read the scheduler unchanged: its Grafana dashboard, llm-d's inference scheduler
and the Gateway API Inference Extension (queue depth, KV usage), KEDA (a Prometheus query).

Every family carries vLLM's labels: `model_name` (the served model's name) and `engine` (the replica's
data-parallel rank, "0" for one).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.scheduler.metrics import SchedulerMetrics

FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values that we end requests with


def vllm_families(
    metrics: SchedulerMetrics,
    *,
    num_running: int,
    num_waiting: int,
    kv_cache_usage: float,
    model_name: str,
    engine: int,
) -> list[Metric]:
    """vLLM's families: `num_running` / `num_waiting` requests, `kv_cache_usage` the
    fraction of KV blocks held (0 to 1, as vLLM's `kv_cache_usage_perc`, despite its name)."""
    labels = [model_name, str(engine)]
    label_names = ["model_name", "engine"]
    families: list[Metric] = []
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", num_waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
        # its older name, which older releases of the Gateway API Inference Extension read
        ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=label_names)
        gauge.add_metric(labels, value)
        families.append(gauge)
    for name, doc, value in (
        (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            metrics.preemptions_total,
        ),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", metrics.prompt_tokens_total),
        ("vllm:generation_tokens", "Number of generation tokens processed.", metrics.generated_tokens_total),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            metrics.prefix_cache_queries_total,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            metrics.prefix_cache_hits_total,
        ),
    ):
        counter = CounterMetricFamily(name, doc, labels=label_names)
        counter.add_metric(labels, value)
        families.append(counter)
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=[*label_names, "finished_reason"],
    )
    reasons = metrics.requests_finished_by_reason
    for reason in (*FINISHED_REASONS, *sorted(set(reasons) - set(FINISHED_REASONS))):
        success.add_metric([*labels, reason], reasons.get(reason, 0))
    families.append(success)
    itl, e2e = metrics.vllm_inter_token_latency, metrics.vllm_e2e_request_latency
    return [
        *families,
        metrics.vllm_time_to_first_token.family(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            label_names,
            labels,
        ),
        itl.family(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            label_names,
            labels,
        ),
        # the older name of the same measure, which vLLM still exports and older dashboards read
        itl.family(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            label_names,
            labels,
        ),
        e2e.family(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            label_names,
            labels,
        ),
    ]
