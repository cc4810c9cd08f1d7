"""Where a traced step's GPU time goes between its forward pass and its sampler (`--step-trace`).

A step's GPU-clock time runs from an event recorded before its forward pass to one recorded after its
sampler; the sampler is queued only after the step before it has been answered and the sampler's host work
(its parameters, structured output's masks) is done. When that host work outlasts the forward pass, the
GPU sits between the two inside the step's own time. Two more events split it:

- `forward_gpu_ms`: the step's start to the end of its forward pass (what was queued before the sampler);
- `sampler_wait_gpu_ms`: the end of the forward pass to the start of the sampler: the GPU waiting for the
  host to queue the sampler (0 when it was queued in time);
- `sampler_gpu_ms`: the sampler itself (the masks' transfer and kernel included) to the step's end.

Beside them the structured-output costs of the sampler's launch, on the host (worker/structured.py
`last_stats`): the constrained rows, how long the launch waited for the masks filled in the background
(`wait_ms`), the rest done in the launch (`host_ms`), the accept and the fill, the transfer's queuing
(`copy_ms`). Only traced CUDA steps record events; elsewhere the GPU keys are absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Marks:
    forward_done: torch.cuda.Event | None = None
    sampler_start: torch.cuda.Event | None = None
    host: dict[str, float] = field(default_factory=dict)


class LaunchTrace:
    """The traced steps' extra events and host costs, by step id, from their launch to their answer."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: dict[int, _Marks] = {}
        self._done: dict[int, dict[str, float]] = {}

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_queued(self, step_id: int) -> None:
        """After the step's forward pass is queued."""
        self._open[step_id] = _Marks(forward_done=self._event())

    def sampler_queuing(self, step_id: int, structured: dict[str, float]) -> None:
        """Just before the step's sampler is queued; `structured`: its masks' host costs (may be empty)."""
        marks = self._open.setdefault(step_id, _Marks())
        marks.sampler_start = self._event()
        marks.host = dict(structured)

    def finished(
        self, step_id: int, started: torch.cuda.Event | None, ended: torch.cuda.Event | None
    ) -> None:
        """The step's events are complete (`ended` synchronized): its split is kept for `take`."""
        marks = self._open.pop(step_id, None)
        if marks is None:
            return
        out = {f"structured_{k}": v for k, v in marks.host.items()}
        if started is not None and ended is not None and marks.forward_done is not None:
            forward = marks.forward_done
            out["forward_gpu_ms"] = round(started.elapsed_time(forward), 3)
            if marks.sampler_start is not None:
                out["sampler_wait_gpu_ms"] = round(forward.elapsed_time(marks.sampler_start), 3)
                out["sampler_gpu_ms"] = round(marks.sampler_start.elapsed_time(ended), 3)
        self._done[step_id] = out

    def take(self, step_id: int) -> dict[str, float]:
        """The step's split (empty when it was not traced), once."""
        return self._done.pop(step_id, {})

    def clear(self) -> None:
        self._open.clear()
        self._done.clear()
