"""What a client's calls and request handles raise."""

from __future__ import annotations


class RequestRejected(Exception):
    """The request cannot be served: refused by the scheduler, or found invalid before sending."""

    def __init__(self, kind: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind  # an ErrorKind value
        self.message = message
        self.request_id = request_id


class ClientClosed(Exception):
    """The client was closed while the request was still running."""
