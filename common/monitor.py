"""ZeroMQ socket monitors on addresses of their own.

pyzmq names a monitor's inproc endpoint after the socket's file descriptor, which a later socket can get
again while libzmq (which tears sockets down later, on its reaper thread) may still hold the old endpoint.
A random name cannot collide. Whoever opens a monitor stops it (`sock.disable_monitor()`) before closing the
returned reader: an event sent to a monitor nobody reads can block libzmq's I/O thread.
"""

from __future__ import annotations

import uuid

import zmq


def open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """The PAIR socket that receives `sock`'s `events` (zmq.EVENT_*); read it with parse_monitor_message."""
    return sock.get_monitor_socket(events, addr=f"inproc://pagedserve-monitor-{uuid.uuid4().hex}")
