"""`python -m pagedserve.worker [flags]`: a worker process; flags and PAGEDSERVE_* variables mirror
WorkerConfig.

Tensor parallelism runs one such process per rank, all with the same `--tensor-parallel-size` and
`--dist-init-method`, each with its own `--rank` (or PAGEDSERVE_RANK). Under honcho with several workers
(`honcho start -c worker=2`), a worker given no rank takes it from its process name: worker.1 is rank 0,
worker.2 rank 1. A setting that cannot work (worker/preflight.py) ends it with one line and exit status 2.
"""

from __future__ import annotations

import os
import sys

from pagedserve.common.config import WorkerConfig, parse_config
from pagedserve.common.interrupts import ignore_further_stops
from pagedserve.common.preflight import ConfigError, exit_config_error
from pagedserve.worker.parallel import honcho_rank
from pagedserve.worker.preflight import check_worker_config
from pagedserve.worker.server import serve


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = honcho_rank()
    if rank is not None and "PAGEDSERVE_RANK" not in os.environ:
        argv = ["--rank", str(rank), *argv]  # a --rank of the command line, later in argv, still wins
    cfg = parse_config(WorkerConfig, argv, description="pagedserve worker: runs the model on StepPlans")
    try:  # a setting that cannot work: one line and status 2, before any load (no restart loop)
        check_worker_config(cfg)
    except ConfigError as e:
        exit_config_error("worker", e)
    code = serve(cfg)
    ignore_further_stops()  # it is exiting (stopped, or told to by the scheduler): see common/interrupts.py
    return code


if __name__ == "__main__":
    sys.exit(main())
