"""A fault fails one request, never the scheduler: the request's sequences end (by force when their
ordinary ending fails half way), its blocks go back, the seat counts are recounted, and its client gets one
error, which the server collects with `Scheduler.take_errors()`: INTERNAL for a bug, INVALID_REQUEST (a 400)
when the worker reports that the request's own constraints cannot be met (`CONSTRAINT_FAILED`)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from pagedserve.common.messages import ErrorKind, FinishReason, RequestError
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.queues import RunQueue
from pagedserve.scheduler.request import Error, Request, SeqStatus, Sequence, SequenceTable

log = structlog.get_logger(process="scheduler")

# StepOutput.failed_seq_ids: the request's grammar failed to compile, or its grammar and its own token rules
# together masked every token of its row (worker/masked_rows.py); the request as sent cannot be served.
CONSTRAINT_FAILED = (
    "the request's output constraint cannot be met: its grammar could not be applied, or it and the "
    "request's own token rules (allowed_token_ids, bad_words, logit_bias, min_tokens) leave no token allowed"
)


class RequestFaults:
    """Ends requests whose handling failed, and keeps their errors until the server takes them."""

    def __init__(
        self,
        requests: dict[tuple[bytes, str], Request],
        seqs: SequenceTable,
        running: RunQueue,
        metrics: SchedulerMetrics,
        finish: Callable[[Sequence, str], None],
        free: Callable[[Sequence], None],
    ) -> None:
        self._requests = requests
        self._seqs = seqs
        self._running = running
        self._metrics = metrics
        self._finish = finish  # the ordinary ending of a sequence
        self._free = free  # returns a sequence's blocks and tells the worker
        self._errors: list[Error] = []

    def take_errors(self) -> list[Error]:
        errors, self._errors = self._errors, []
        return errors

    def fail_request(
        self, request: Request, message: str, exc_info: bool = False, kind: str = ErrorKind.INTERNAL
    ) -> None:
        """Ends every sequence of `request`, frees its blocks and queues a `kind` error for its client.
        Works on state that the failure may have left half changed: a sequence that cannot be finished the
        ordinary way is dropped by force, and the seat counts are recounted."""
        log.error("request_failed", request_id=request.request_id, reason=message, exc_info=exc_info)
        self._metrics.requests_failed_total += 1
        for seq in reversed(request.seqs):  # fork children before their parent
            if seq.status is SeqStatus.FINISHED:
                continue
            try:
                self._finish(seq, FinishReason.ABORT)
            except Exception:
                self._drop(seq)
        if self._requests.get(request.key) is request:
            del self._requests[request.key]
        self._running.prune()
        searches = {s.request.key: s.request for s in self._seqs.values() if s.request.beam}
        self._running.recount_seats(searches.values())
        self._errors.append((request.owner, RequestError(request.request_id, kind, message)))

    def _drop(self, seq: Sequence) -> None:
        """Forgets a sequence whose ordinary ending failed half way."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        seq.fork_children = []
        if seq in seq.request.live_beams:
            seq.request.live_beams.remove(seq)
        self._free(seq)
        self._seqs.pop(seq.seq_id, None)
