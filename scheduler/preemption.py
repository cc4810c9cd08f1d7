"""The preemption policy: which running sequence gives way when the KV pool has no block, and how.

The victim is the last running sequence in queue order that the step has not scheduled yet
(`RunQueue.pick_victim`, scheduler/queues.py). Queue order is this policy's `sort_key`: (priority, arrival,
seq_id) under the priority scheduling policy, (0, arrival, seq_id) under fcfs; so the newest sequence gives
way first, or under priority the least urgent. The victim either keeps its KV in the worker's CPU pool
(swap) or frees it and computes it again once readmitted (recompute), as `preemption_mode` says; "auto"
decides per victim. Either way it resumes with exactly the tokens it would have produced: a sequence's
randomness depends only on its seed and the position.
"""

from __future__ import annotations

from pagedserve.common.config import PreemptionMode, SchedulingPolicy
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.scheduler.settings import SchedulerSettings

# Under preemption_mode "auto", a victim with at least this many computed tokens is swapped: recomputing
# its KV would cost more than copying it over PCIe and back.
SWAP_MIN_TOKENS = 256


class PreemptionPolicy:
    """The queue order (the victim is the last in it) and the swap-or-recompute rule."""

    def __init__(self, mode: PreemptionMode, scheduling_policy: SchedulingPolicy) -> None:
        self.mode = mode
        self.by_priority = scheduling_policy == "priority"

    @classmethod
    def from_settings(cls, settings: SchedulerSettings) -> PreemptionPolicy:
        """The policy the settings name (a new policy's own settings are read here, not by its callers)."""
        return cls(settings.preemption_mode, settings.scheduling_policy)

    @property
    def uses_cpu_pool(self) -> bool:
        return self.mode != "recompute"

    def sort_key(self, request: Request, seq_id: int) -> tuple[int, int, int]:
        """A sequence's place in every queue (waiting, running, swapped): first in, last to give way."""
        return (request.priority if self.by_priority else 0, request.order, seq_id)

    def swaps(self, seq: Sequence) -> bool:
        """Whether the victim should keep its KV in the CPU pool rather than recompute it (if the pool has
        room). Beams are recomputed: a swapped idle beam could block its search."""
        if seq.request.beam is not None:
            return False
        return self.mode == "swap" or (self.mode == "auto" and seq.num_computed_tokens >= SWAP_MIN_TOKENS)
