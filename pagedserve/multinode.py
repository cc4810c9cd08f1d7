"""One replica over several hosts: `pagedserve serve MODEL --nnodes N --node-rank R --dist-init-addr
HOST:PORT` (SGLang's flags), run once on each host.

The replica's --tensor-parallel-size ranks are split evenly over the N hosts: host R runs ranks R*L .. R*L+L-1
(L = tensor_parallel_size / N), which take its GPUs 0 .. L-1 (worker/parallel.py: rank modulo the host's GPU
count). Host 0 also runs the api and the scheduler; the other hosts run only their worker ranks. Every rank
meets the others at HOST:PORT (torch.distributed's TCP rendezvous, hosted by rank 0 on host 0: NCCL on GPUs,
gloo on the CPU).

Only rank 0 talks to the scheduler (over ZeroMQ, CURVE-locked with the cluster key); the other ranks follow
rank 0 over the process group and never open a socket of their own. The scheduler's worker address is
derived from HOST, so that one flag describes the cluster: host 0's scheduler binds HOST's address (resolved
on host 0) at --worker-address's port, and rank 0 connects there. A --worker-address given explicitly is
used as it is; one with a wildcard host (0.0.0.0, *) is bound on every interface and reached at HOST. Every
host's processes carry the same derived settings.

Across hosts the GPUs cannot map each other's memory, so --tp-all-reduce auto becomes nccl (worker/
tp_all_reduce.py's one-shot kernels need every rank on one host), and the one-shot modes are refused.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pagedserve.common.config import DEFAULT_WORKER_ADDRESS

_WILDCARD_HOSTS = ("0.0.0.0", "*", "::")


@dataclass(frozen=True)
class NodeConfig:
    """This host's place in a replica spread over several hosts (`pagedserve serve` only)."""

    # Hosts the replica's tensor-parallel ranks are spread over, tensor_parallel_size / nnodes ranks each
    nnodes: int = 1
    # This host's index: 0 runs the api, the scheduler and ranks 0..; R > 0 runs only its own worker ranks
    node_rank: int = 0
    # HOST:PORT of host 0, where the ranks of every host meet (sets --dist-init-method); the scheduler's
    # worker address is derived from HOST at --worker-address's port. Required with nnodes > 1
    dist_init_addr: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.nnodes <= 1024:
            raise ValueError(f"nnodes must be in [1, 1024], got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of host 0, where the ranks meet)")
        if self.dist_init_addr:
            split_host_port(self.dist_init_addr)

    @property
    def runs_frontend(self) -> bool:
        """Whether this host runs the api and the scheduler."""
        return self.node_rank == 0

    def local_ranks(self, tensor_parallel_size: int) -> range:
        """The worker ranks this host runs; ValueError when the hosts cannot hold equal shares."""
        if tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} must be a multiple of nnodes {self.nnodes} "
                "(every host runs the same number of ranks)"
            )
        per_node = tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def split_host_port(addr: str) -> tuple[str, int]:
    """("HOST", PORT) of "HOST:PORT" ("[v6]:PORT" for IPv6); ValueError otherwise."""
    parts = urlsplit("//" + addr)
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}: {e}") from None
    if not parts.hostname or port is None or parts.path or parts.query or parts.username:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return parts.hostname, port


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _resolve(host: str) -> str:
    """HOST's address, for a ZeroMQ bind (which takes no DNS name)."""
    error: OSError | None = None
    for family in (socket.AF_INET, socket.AF_UNSPEC):  # IPv4 first: an IPv6 bind needs zmq.IPV6 set
        try:
            return str(socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0])
        except OSError as e:
            error = e
    raise ValueError(f"dist_init_addr's host {host!r} does not resolve here: {error}")


def node_settings(node: NodeConfig, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings of this host's processes, `values` with the rendezvous and the worker address derived
    from dist_init_addr, and the scheduler's own worker address (what it binds; empty: the shared one).
    `values` is returned unchanged at nnodes 1 without dist_init_addr."""
    if not node.dist_init_addr:
        return values, {}
    host, port = split_host_port(node.dist_init_addr)
    derived = dict(values, dist_init_method=f"tcp://{_url_host(host)}:{port}")
    if node.nnodes == 1:
        return derived, {}
    all_reduce = values.get("tp_all_reduce", "auto")
    if all_reduce not in ("auto", "nccl"):
        raise ValueError(f"tp_all_reduce {all_reduce} needs every rank on one host; with nnodes > 1: nccl")
    derived["tp_all_reduce"] = "nccl"
    given = values["worker_address"]
    worker_port = urlsplit(given).port or urlsplit(DEFAULT_WORKER_ADDRESS).port
    if given == DEFAULT_WORKER_ADDRESS:  # derived: host 0 binds HOST's own address, rank 0 connects there
        bind = f"tcp://{_url_host(_resolve(host))}:{worker_port}" if node.runs_frontend else ""
        connect = f"tcp://{_url_host(host)}:{worker_port}"
    elif urlsplit(given).hostname in _WILDCARD_HOSTS:  # bound on every interface, reached at HOST
        bind, connect = given, f"tcp://{_url_host(host)}:{worker_port}"
    else:
        bind = connect = given
    derived["worker_address"] = connect
    return derived, ({"worker_address": bind} if node.runs_frontend and bind != connect else {})
