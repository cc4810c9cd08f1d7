"""The scheduler's settings come from its config and the worker's announcement, in one place."""

from __future__ import annotations

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import SamplingParams, WorkerReady
from pagedserve.scheduler.preemption import PreemptionPolicy
from pagedserve.scheduler.queues import RunQueue
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.scheduler.settings import SchedulerSettings


def _ready(**fields) -> WorkerReady:
    return WorkerReady(1000, 16, 2048, 4096, [2], "/m", "m", num_cpu_blocks=64, **fields)


def test_the_settings_default_to_the_configs_policies():
    settings = SchedulerSettings.from_config(SchedulerConfig(), _ready())
    plain = SchedulerSettings(1000, 16, 2048, 4096, (2,), 512, 8192)
    config = SchedulerConfig()
    for name in (
        "preemption_mode",
        "scheduling_policy",
        "kv_policy",
        "max_waiting_seqs",
        "request_seat_quota",
    ):
        assert getattr(settings, name) == getattr(plain, name) == getattr(config, name), name
    assert plain.preemption_mode == "auto"


def test_the_batch_limits_are_the_smaller_of_the_schedulers_and_the_workers():
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=1024)
    settings = SchedulerSettings.from_config(config, _ready(max_num_seqs=512, max_num_batched_tokens=4096))
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (256, 4096)
    assert settings.max_model_len == 1024 and settings.num_kv_blocks == 1000 and settings.num_cpu_blocks == 64
    unknown = SchedulerSettings.from_config(config, _ready())  # a worker that announces no limits (0)
    assert (unknown.max_num_seqs, unknown.max_num_batched_tokens) == (256, 8192)


def test_the_victim_is_the_last_unscheduled_in_queue_order():
    """Newest first under fcfs; least urgent first (the larger priority value) under priority."""
    for policy, order in (("fcfs", [3, 2, 1]), ("priority", [1, 3, 2])):
        preemption = PreemptionPolicy("recompute", policy)
        running = RunQueue()
        for seq_id, priority in ((1, 5), (2, 0), (3, 0)):
            request = Request(b"o", str(seq_id), [1], SamplingParams(), 0.0, priority=priority, order=seq_id)
            seq = Sequence(seq_id, request, 0, 0, [1], sort_key=preemption.sort_key(request, seq_id))
            request.seqs.append(seq)
            running.add(seq)
        first, second, third = order
        assert running.pick_victim(scheduled={first}).seq_id == second  # a scheduled one is not taken
        assert running.pick_victim().seq_id == first
        assert [s.seq_id for s in running] == [third] and running.seats_taken == 1
