"""The request fields that say how the scheduler treats a request rather than what it generates."""

from __future__ import annotations

from pagedserve.api.errors import invalid
from pagedserve.api.fields import Fields
from pagedserve.api.model import ServedModel


def parse_priority(f: Fields, model: ServedModel) -> int:
    """`priority` (vLLM's extension: lower runs first). Under the scheduler's fcfs policy any value but 0
    would be silently ignored, so it is refused with vLLM's message; the policy is the scheduler's
    (InfoReply.scheduling_policy, learnt with the model)."""
    priority: int = f.integer("priority", 0)  # type: ignore[assignment]
    if priority != 0 and model.scheduling_policy != "priority":
        raise invalid(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
    return priority
