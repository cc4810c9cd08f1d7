"""The flags of `pagedserve serve` that run replicas behind a router; they belong to the launcher alone."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal

from pagedserve.common.config import check_choices

RouterName = Literal["vllm-router", "none"]
# vllm-router's policies that place requests among equal replicas (its others are for prefill/decode pools)
RouterPolicy = Literal["kv_aware", "cache_aware", "power_of_two", "round_robin"]
MAX_REPLICAS = 64


@dataclass(frozen=True)
class ReplicasConfig:
    """How many replicas to run, and the router in front of them."""

    # Independent replicas (each an api, a scheduler and its tensor-parallel ranks, on GPUs of its own),
    # behind the router on --port; 1: one server on --port, no router
    data_parallel_size: int = 1
    # The router started on --port in front of the replicas (pip install vllm-router); none: no router, the
    # replicas alone on ports --port+1 ... --port+N
    router: RouterName = "vllm-router"
    # How the router places requests; kv_aware follows each replica's KV-cache events (turned on for it)
    router_policy: RouterPolicy = "kv_aware"
    router_args: str = ""  # more arguments for the router, as a shell would split them (they win)

    def __post_init__(self) -> None:
        check_choices(self)
        if not 1 <= self.data_parallel_size <= MAX_REPLICAS:
            raise ValueError(f"data_parallel_size must be in [1, {MAX_REPLICAS}]")
        try:
            shlex.split(self.router_args)
        except ValueError as e:
            raise ValueError(f"router_args: {e}") from None
