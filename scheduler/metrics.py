"""The scheduler's metrics and their Prometheus families (common/exposition.py renders them)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from pagedserve.scheduler.request import Request, Sequence

ACCEPTED_BUCKETS = tuple(float(n) for n in range(17))  # accepted drafts of one sequence in one step
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0
)  # fmt: skip
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read ours alike
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)  # fmt: skip
VLLM_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def family(
        self, name: str, doc: str, label_names: Sequence[str] = (), labels: Sequence[str] = ()
    ) -> HistogramMetricFamily:
        """This histogram as a Prometheus family (cumulative buckets, as the format counts them)."""
        family = HistogramMetricFamily(name, doc, labels=label_names)
        cumulative, buckets = 0, []
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            buckets.append((str(bound), cumulative))
        buckets.append(("+Inf", self.count))
        family.add_metric(labels, buckets, self.total)
        return family


@dataclass
class SchedulerMetrics:
    """Counters and histograms the scheduler core updates; gauges are read from its state at render time."""

    preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_rejected_total: int = 0
    requests_overloaded_total: int = 0  # refused because the waiting queue was full (503)
    requests_failed_total: int = 0  # ended by an internal fault while the core handled them
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found
    swap_outs_total: int = 0
    swap_ins_total: int = 0
    steps_total: int = 0  # steps the worker finished
    decode_steps_total: int = 0  # of which every sequence decoded one token (CUDA graphs run these)
    gpu_seconds_total: float = 0.0  # the worker's GPU time over every step
    decode_gpu_seconds_total: float = 0.0  # over decode-only steps
    # decode-only steps on the GPU's clock: the GPU's idle time before each + its GPU time
    decode_step_seconds_total: float = 0.0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    # speculative decoding (scheduler/speculation.py): drafts verified, of which accepted, and per drafting
    # sequence and step the number accepted
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_acceptance_length: Histogram = field(default_factory=lambda: Histogram(buckets=ACCEPTED_BUCKETS))
    # the same times in vLLM's buckets (scheduler/vllm_metrics.py), and each request's arrival to its end
    vllm_time_to_first_token: Histogram = field(default_factory=lambda: Histogram(buckets=VLLM_TTFT_BUCKETS))
    vllm_inter_token_latency: Histogram = field(default_factory=lambda: Histogram(buckets=VLLM_ITL_BUCKETS))
    vllm_e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(buckets=VLLM_E2E_BUCKETS))
    requests_finished_by_reason: dict[str, int] = field(default_factory=dict)  # "stop", "length", "abort"

    def observe_step(self, gpu_time_s: float, gpu_idle_before_s: float, decode_only: bool) -> None:
        """GPU time of every step; for decode-only steps also their span on the GPU's clock, from the end
        of the step before to their own end (a decode-only step always follows another step at once, so
        the GPU's idle time before it is what the host made it wait). On the GPU's clock rather than from
        update to update, since the worker queues a step before it answers the one before."""
        self.steps_total += 1
        self.gpu_seconds_total += gpu_time_s
        if decode_only:
            self.decode_steps_total += 1
            self.decode_gpu_seconds_total += gpu_time_s
            self.decode_step_seconds_total += gpu_time_s + gpu_idle_before_s

    def observe_token(self, seq: Sequence, now: float) -> None:
        """A token of `seq`: its time to first token, or the time since its last token."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.time_to_first_token.observe(now - seq.request.arrival_time)
            self.vllm_time_to_first_token.observe(now - seq.request.arrival_time)
        else:
            self.observe_interval(now - seq.last_token_time)
        seq.last_token_time = now

    def observe_interval(self, seconds: float) -> None:
        """The time between two consecutive tokens of a sequence."""
        self.inter_token_latency.observe(seconds)
        self.vllm_inter_token_latency.observe(seconds)

    def observe_finished(self, request: Request, reason: str, now: float) -> None:
        """A request ended (its last sequence with `reason`)."""
        self.requests_finished_total += 1
        self.requests_finished_by_reason[reason] = self.requests_finished_by_reason.get(reason, 0) + 1
        self.vllm_e2e_request_latency.observe(now - request.arrival_time)

    def families(self, gauges: dict[str, tuple[float, str]]) -> list[Metric]:
        """Our families (pagedserve_*) for these metrics plus `gauges` (name -> (value, help))."""
        families: list[Metric] = [
            GaugeMetricFamily(name, doc, value) for name, (value, doc) in gauges.items()
        ]
        counters = {
            "pagedserve_preemptions_total": (self.preemptions_total, "Sequences preempted (KV freed)"),
            "pagedserve_prompt_tokens_total": (self.prompt_tokens_total, "Prompt tokens accepted"),
            "pagedserve_generated_tokens_total": (self.generated_tokens_total, "Tokens generated"),
            "pagedserve_requests_finished_total": (self.requests_finished_total, "Requests finished"),
            "pagedserve_requests_rejected_total": (self.requests_rejected_total, "Requests refused"),
            "pagedserve_requests_overloaded_total": (
                self.requests_overloaded_total,
                "Requests refused because too many sequences were waiting",
            ),
            "pagedserve_requests_failed_total": (
                self.requests_failed_total,
                "Requests ended by an internal fault",
            ),
            "pagedserve_prefix_cache_queries_total": (
                self.prefix_cache_queries_total,
                "Prompt tokens looked up in the prefix cache",
            ),
            "pagedserve_prefix_cache_hits_total": (
                self.prefix_cache_hits_total,
                "Prompt tokens found",
            ),
            "pagedserve_swap_outs_total": (self.swap_outs_total, "Sequences swapped out to the CPU pool"),
            "pagedserve_swap_ins_total": (self.swap_ins_total, "Sequences swapped back in"),
            "pagedserve_steps_total": (self.steps_total, "Steps the worker finished"),
            "pagedserve_decode_steps_total": (self.decode_steps_total, "Of which decode-only steps"),
            "pagedserve_gpu_seconds_total": (self.gpu_seconds_total, "Worker GPU time over all steps"),
            "pagedserve_decode_gpu_seconds_total": (
                self.decode_gpu_seconds_total,
                "Worker GPU time over decode-only steps",
            ),
            "pagedserve_decode_step_seconds_total": (
                self.decode_step_seconds_total,
                "Time of decode-only steps on the GPU's clock, from the end of the step before to their end",
            ),
            "pagedserve_spec_draft_tokens_total": (
                self.spec_draft_tokens_total,
                "Draft tokens verified (speculative decoding)",
            ),
            "pagedserve_spec_accepted_tokens_total": (
                self.spec_accepted_tokens_total,
                "Draft tokens accepted",
            ),
        }
        families += [CounterMetricFamily(name, doc, value) for name, (value, doc) in counters.items()]
        return [
            *families,
            self.time_to_first_token.family(
                "pagedserve_time_to_first_token_seconds", "From arrival to the first generated token"
            ),
            self.inter_token_latency.family(
                "pagedserve_inter_token_latency_seconds", "Between consecutive tokens of a sequence"
            ),
            self.spec_acceptance_length.family(
                "pagedserve_spec_acceptance_length", "Draft tokens accepted per drafting sequence and step"
            ),
        ]
