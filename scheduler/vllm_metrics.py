"""vLLM's metric names, types, labels and buckets (`vllm/v1/metrics/loggers.py`), beside our own, so that
tools written for vLLM read the scheduler unchanged: its Grafana dashboard, llm-d's inference scheduler
and the Gateway API Inference Extension (queue depth, KV usage), KEDA (a Prometheus query).

Every family carries vLLM's labels: `model_name` (the served model's name) and `engine` (the replica's
data-parallel rank, "0" for one). Rendered with prometheus_client's own exposition.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.scheduler.metrics import Histogram, SchedulerMetrics

FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values that we end requests with


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _histogram(name: str, doc: str, labels: list[str], histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
    cumulative, buckets = 0, []
    for bound, n in zip(histogram.buckets, histogram.counts, strict=False):
        cumulative += n
        buckets.append((str(bound), cumulative))
    buckets.append(("+Inf", histogram.count))
    family.add_metric(labels, buckets, histogram.total)
    return family


def render_vllm_metrics(
    metrics: SchedulerMetrics,
    *,
    num_running: int,
    num_waiting: int,
    kv_cache_usage: float,
    model_name: str,
    engine: int,
) -> str:
    """vLLM's families in Prometheus text: `num_running` / `num_waiting` requests, `kv_cache_usage` the
    fraction of KV blocks held (0 to 1, as vLLM's `kv_cache_usage_perc`, despite its name)."""
    labels = [model_name, str(engine)]
    label_names = ["model_name", "engine"]
    families: list[Metric] = []
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", num_waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
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
    itl = metrics.vllm_inter_token_latency
    families += [
        _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            metrics.vllm_time_to_first_token,
        ),
        _histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels, itl
        ),
        # the older name of the same measure, which vLLM still exports and older dashboards read
        _histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            itl,
        ),
        _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            metrics.vllm_e2e_request_latency,
        ),
    ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()
