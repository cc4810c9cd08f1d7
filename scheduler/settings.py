"""The scheduler's settings: what the worker announced, narrowed by the scheduler's own config, built in one
place (`SchedulerSettings.from_config`). The policies' defaults are the config's."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from pagedserve.common.config import (
    DEFAULT_MAX_NUM_SEQS,
    KVPolicy,
    PreemptionMode,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagedserve.common.kv_events_config import kv_events_enabled
from pagedserve.common.messages import SubmitRequest, WorkerReady
from pagedserve.scheduler.request import Sequence, num_seqs

log = structlog.get_logger(process="scheduler")

_CONFIG = SchedulerConfig()  # the defaults


@dataclass(frozen=True)
class SchedulerSettings:
    """What the worker announced, narrowed by the scheduler's own config."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = _CONFIG.enable_prefix_caching
    preemption_mode: PreemptionMode = _CONFIG.preemption_mode
    scheduling_policy: SchedulingPolicy = _CONFIG.scheduling_policy
    kv_policy: KVPolicy = _CONFIG.kv_policy
    max_waiting_seqs: int = _CONFIG.max_waiting_seqs  # queued and not running, at most; beyond it 503
    # while other requests wait, a request's first sequence takes at most this many seats with it (itself
    # and the n > 1 samples forked from its prompt); 0: max_num_seqs // 8
    request_seat_quota: int = _CONFIG.request_seat_quota
    # speculative decoding: the worker's k (0: off) and the policy's knobs (scheduler/speculation.py)
    num_speculative_tokens: int = 0
    speculative_draft_budget: int = _CONFIG.speculative_draft_budget
    speculative_min_accepted: float = _CONFIG.speculative_min_accepted
    speculative_probe_steps: int = _CONFIG.speculative_probe_steps
    # the worker's model slides every layer over at least this many tokens (0: some layer reads everything)
    sliding_window: int = 0
    kv_events: bool = False  # the block manager records KV-cache events (scheduler/kv_events)
    model_name: str = ""  # the served model's name: the model_name label of vLLM's metrics
    data_parallel_rank: int = 0  # the engine label of vLLM's metrics
    # KV tiers below the pool (docs/kv_tiers.md): the worker's host memory and disk slots (0: none)
    num_host_tier_blocks: int = 0
    num_disk_tier_blocks: int = 0
    tier_block_bytes: int = 0  # one block's bytes there (metrics)

    @classmethod
    def from_config(cls, config: SchedulerConfig, ready: WorkerReady) -> SchedulerSettings:
        """The settings for a worker that announced itself with `ready`: the pool and the model are the
        worker's; max_model_len and the batch limits are the smaller of the config's and the worker's
        (a worker sized its CUDA graphs and memory profile for its limits; 0 there: not known)."""
        max_model_len = ready.max_model_len
        if config.max_model_len:
            max_model_len = min(max_model_len, config.max_model_len)
        limits = {}
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            mine, workers = getattr(config, name), getattr(ready, name)
            if name == "max_num_seqs" and not mine:  # 0: the worker's (announcing none: the old default)
                mine = workers or DEFAULT_MAX_NUM_SEQS
            limits[name] = min(mine, workers) if workers else mine
            if workers and workers != mine:
                log.warning(
                    "batch_limit_differs", limit=name, scheduler=mine, worker=workers, used=limits[name]
                )
        return cls(
            num_kv_blocks=ready.num_kv_blocks,
            block_size=ready.block_size,
            max_model_len=max_model_len,
            vocab_size=ready.vocab_size,
            eos_token_ids=tuple(ready.eos_token_ids),
            num_cpu_blocks=ready.num_cpu_blocks,
            num_host_tier_blocks=ready.num_host_tier_blocks,
            num_disk_tier_blocks=ready.num_disk_tier_blocks,
            tier_block_bytes=ready.tier_block_bytes,
            enable_prefix_caching=config.enable_prefix_caching,
            preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy,
            kv_policy=config.kv_policy,
            max_waiting_seqs=config.max_waiting_seqs,
            request_seat_quota=config.request_seat_quota,
            num_speculative_tokens=ready.num_speculative_tokens,
            speculative_draft_budget=config.speculative_draft_budget,
            speculative_min_accepted=config.speculative_min_accepted,
            speculative_probe_steps=config.speculative_probe_steps,
            sliding_window=ready.sliding_window,
            kv_events=kv_events_enabled(config.kv_events_config),
            model_name=ready.model_name,
            data_parallel_rank=config.data_parallel_rank,
            **limits,
        )

    @property
    def watermark_blocks(self) -> int:
        # Admission leaves this many blocks free so running sequences can grow a while before preempting.
        return self.num_kv_blocks // 100

    @property
    def freeing_window(self) -> int:
        """The window behind which the block manager frees blocks: the model's, under the paged policy (the
        reserved ones claim a sequence's whole room by design); 0: no freeing."""
        return 0 if self.reserved else self.sliding_window

    def peak_tokens(self, room: int) -> int:
        """The KV slots a sequence of `room` tokens holds at once. With blocks freed behind the window (after
        each step, behind its first query: the block manager's `free_behind_window`): the window, the chunks
        of this step and the last (max_num_batched_tokens each at most) and two partial blocks."""
        if not self.freeing_window:
            return room
        peak = self.freeing_window + 2 * self.max_num_batched_tokens + 2 * self.block_size
        return min(room, peak)

    @property
    def seat_quota(self) -> int:
        return self.request_seat_quota or max(1, self.max_num_seqs // 8)

    @property
    def reserved(self) -> bool:
        """A baseline policy that claims each sequence's whole room at admission."""
        return self.kv_policy != "paged"

    def room(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The KV slots a sequence of such a request may come to hold; what the reserved policies claim at
        admission (reserved-max: max_model_len, as a server that knows nothing of the request's length)."""
        if self.kv_policy == "reserved-max":
            return self.max_model_len
        return min(num_prompt_tokens + max_tokens, self.max_model_len)

    def reserve_tokens(self, seq: Sequence) -> int:
        """Reserved policies: the sequence's whole room, claimed at admission; 0 when paged."""
        if not self.reserved:
            return 0
        return self.room(seq.num_prompt_tokens, seq.request.params.max_tokens)


def check_request(settings: SchedulerSettings, msg: SubmitRequest) -> str | None:
    """Why the request can never be served as sent, or None. Raises on a field of the wrong type."""
    problem = msg.params.validate()
    if problem is not None:
        return problem
    if type(msg.priority) is not int or type(msg.cache_salt) is not str:
        return "priority must be an integer and cache_salt a string"
    if msg.priority != 0 and settings.scheduling_policy != "priority":  # it would change nothing: say so
        return f"Got priority {msg.priority} but Priority scheduling is not enabled."
    prompt = msg.prompt_token_ids
    if not prompt:
        return "the prompt is empty"
    vocab = settings.vocab_size
    if not all(type(t) is int and 0 <= t < vocab for t in prompt):
        bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
        return f"token id {bad!r} is outside the vocabulary [0, {vocab})"
    problem = msg.params.vocab_problem(vocab)
    if problem is not None:
        return problem
    total = len(prompt) + msg.params.max_tokens
    if total > settings.max_model_len:
        return (
            f"this model's maximum context length is {settings.max_model_len} tokens, but "
            f"{total} were requested ({len(prompt)} in the prompt, {msg.params.max_tokens} to generate)"
        )
    if num_seqs(msg.params) > settings.max_waiting_seqs:
        return (
            f"this request makes {num_seqs(msg.params)} sequences; at most "
            f"{settings.max_waiting_seqs} may wait in the scheduler"
        )
    room = settings.peak_tokens(settings.room(len(prompt), msg.params.max_tokens))
    num_kv_blocks = -(-room // settings.block_size)
    if num_kv_blocks > settings.num_kv_blocks:
        pool = settings.num_kv_blocks
        return f"{room} tokens need {num_kv_blocks} KV blocks, more than the whole pool of {pool}"
    return None
