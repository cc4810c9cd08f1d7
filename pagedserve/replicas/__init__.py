"""Replicas behind an existing router: `pagedserve serve MODEL --data-parallel-size N` (docs/scaling.md).

N independent replicas, each an api + scheduler + its tensor-parallel worker ranks on its own ports,
addresses and GPUs, all under the launcher's supervision, behind a router that no one here wrote
(vllm-router by default), which the launcher starts on --port. Nothing here routes a request itself.

config.py   ReplicasConfig: --data-parallel-size, --router, --router-policy, --router-args (their flags)
plan.py     replicate(): the serve command's processes, once per replica with its own settings (port+1+i,
            addresses, --data-parallel-rank i, KV-event sockets, CUDA_VISIBLE_DEVICES), plus the router
router.py   the router's command line (its KV-event sources, health checks, a free metrics port), and
            `python -m pagedserve.replicas.router`, which the supervisor runs and which becomes the router
"""
