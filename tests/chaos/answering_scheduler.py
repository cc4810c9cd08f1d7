"""A scripted scheduler for client tests: a CURVE ROUTER on 127.0.0.1 in a thread of its own, so that it
keeps running while a test blocks its own event loop."""

from __future__ import annotations

import threading
import time

import zmq

from pagedserve.common.messages import (
    InfoReply,
    InfoRequest,
    Message,
    RequestOutputs,
    SeqOutput,
    SubmitRequest,
    decode,
    encode,
)
from pagedserve.common.security import ClusterKey, secure_server
from pagedserve.common.socket_limits import Receiver, max_message_bytes


class AnsweringScheduler:
    """Answers every InfoRequest at once and finishes every SubmitRequest (one token, "length")
    `answer_after_s` after it arrives. No authenticator: the CURVE handshake alone needs the key."""

    def __init__(self, key: ClusterKey, answer_after_s: float) -> None:
        self.key = key
        self.answer_after_s = answer_after_s
        self.submitted_at: list[float] = []  # monotonic arrival of each SubmitRequest
        self._address: list[str] = []
        self._bound = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="answering-scheduler", daemon=True)

    def __enter__(self) -> AnsweringScheduler:
        self._thread.start()
        assert self._bound.wait(10), "the scripted scheduler did not bind"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def address(self) -> str:
        return self._address[0]

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_server(sock, self.key, max_message_bytes(Receiver.SCHEDULER_CLIENTS))
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self._address.append(f"tcp://127.0.0.1:{port}")
        self._bound.set()
        due: list[tuple[float, bytes, SubmitRequest]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(10):
                    identity, *frames = sock.recv_multipart()
                    msg: Message = decode(frames)
                    if isinstance(msg, InfoRequest):
                        reply = InfoReply(msg.query_id, True, "/m", "m", 64, 1000, 4, 64, "")
                        sock.send_multipart([identity, *encode(reply)])
                    elif isinstance(msg, SubmitRequest):
                        self.submitted_at.append(time.monotonic())
                        due.append((time.monotonic() + self.answer_after_s, identity, msg))
                now = time.monotonic()
                for item in [d for d in due if d[0] <= now]:
                    due.remove(item)
                    _, identity, submit = item
                    out = SeqOutput(submit.request_id, 0, [7], None, "length", len(submit.prompt_token_ids))
                    sock.send_multipart([identity, *encode(RequestOutputs([out]))])
        finally:
            sock.close()
            ctx.term()
