"""`python -m worker [flags]`: a worker process; flags and PAGEDSERVE_* variables mirror WorkerConfig."""

from __future__ import annotations

import sys

from common.config import WorkerConfig, parse_config
from worker.server import serve


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(WorkerConfig, argv, description="pagedserve worker: runs the model on StepPlans")
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
