"""The scheduler's sends to its clients: they never wait. A client that went away or stopped reading is
told apart by the error of a send, and its requests end; the request id of a submission that failed to
decode, so that its sender learns why it gets no answer; and the answer to an InfoRequest."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import structlog
import zmq
import zmq.asyncio

from pagedserve.common.messages import (
    InfoReply,
    Message,
    MsgType,
    RequestOutputs,
    SeqOutput,
    WorkerReady,
    encode,
)
from pagedserve.common.wire_types import MAX_REQUEST_ID_CHARS
from pagedserve.scheduler.request import Output

if TYPE_CHECKING:
    from pagedserve.scheduler.scheduler import Scheduler

log = structlog.get_logger(process="scheduler")
# Messages queued for one client before it counts as not reading (a stopped process: its own socket takes
# everything while it runs). Bounds the scheduler's memory per client.
CLIENT_SNDHWM = 10_000


def submitted_request_id(frames: list[bytes]) -> str | None:
    """The request id of a SubmitRequest that failed to decode, read without the types, or None."""
    if len(frames) != 2 or frames[0] != bytes([MsgType.SUBMIT]):
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1])
    except Exception:  # hostile bytes: msgspec raises UnicodeDecodeError for a str that is not UTF-8, too
        return None
    request_id = fields[0] if isinstance(fields, list) and fields else None
    return request_id if isinstance(request_id, str) and len(request_id) <= MAX_REQUEST_ID_CHARS else None


class ClientSender:
    """Sends on the clients' ROUTER socket without waiting. A client that is gone or does not read loses
    its requests instead (`on_unreachable(owner)`, once), and nothing more goes to it until it is heard
    from again."""

    def __init__(self, socket: zmq.asyncio.Socket, on_unreachable: Callable[[bytes], None]) -> None:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that is gone fails, not vanishes
        socket.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        self._socket = socket
        self._on_unreachable = on_unreachable
        self._unreachable: set[bytes] = set()  # clients whose requests ended because sends to them failed

    def heard_from(self, owner: bytes) -> None:
        """The client sent something (it may be sent to again), or left (it is forgotten)."""
        self._unreachable.discard(owner)

    def send(self, owner: bytes, msg: Message) -> None:
        if owner in self._unreachable:
            return
        sent = self._socket.send_multipart([owner, *encode(msg)], copy=False, flags=zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None
        if error is None:
            return
        self._unreachable.add(owner)
        reason = "not reading" if isinstance(error, zmq.Again) else "gone"
        log.warning("client_unreachable", client=owner.hex(), reason=reason)
        self._on_unreachable(owner)

    def send_outputs(self, outputs: list[Output]) -> None:
        """One RequestOutputs message per client."""
        by_owner: dict[bytes, list[SeqOutput]] = defaultdict(list)
        for owner, output in outputs:
            by_owner[owner].append(output)
            if output.finish_reason is not None:
                log.debug(
                    "sequence_finished",
                    request_id=output.request_id,
                    index=output.index,
                    finish_reason=output.finish_reason,
                )
        for owner, outs in by_owner.items():
            self.send(owner, RequestOutputs(outs))


def info_reply(
    query_id: int,
    core: Scheduler | None,
    ready: WorkerReady | None,
    draining: bool,
    extra_metrics: str = "",
    instance_id: str = "",
) -> InfoReply:
    """What the scheduler serves now (not ready without a worker); `extra_metrics` is appended to the core's
    Prometheus text; `instance_id` tells an api whether this is its own instance's scheduler."""
    if core is None or ready is None:
        return InfoReply(query_id, False, "", "", 0, 0, 0, 0, "", instance_id=instance_id)
    settings = core.settings
    return InfoReply(
        query_id=query_id,
        ready=not draining,
        model_root=ready.model_root,
        model_name=ready.model_name,
        max_model_len=settings.max_model_len,
        vocab_size=settings.vocab_size,
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        metrics_text=core.metrics_text() + extra_metrics,
        scheduling_policy=settings.scheduling_policy,
        instance_id=instance_id,
    )
