"""The worker's KV tiers below the device pool: host memory and disk (docs/kv_tiers.md). It moves the bytes
that each plan names; the scheduler (scheduler/kv_tiers/) decides which block lives where.

    mover.py  KVTiers: the host tier's pool (pinned on CUDA) and each plan's copies, on a side stream;
              attach_kv_tiers sizes the tiers (--kv-offload-gb, --kv-disk-dir, --kv-disk-gb) at start
    disk.py   DiskTier: one checked file per disk slot (checksum, model/config identity); a bad one is a miss
"""

from pagedserve.worker.kv_tiers.disk import DiskTier
from pagedserve.worker.kv_tiers.mover import KVTiers, attach_kv_tiers

__all__ = ["DiskTier", "KVTiers", "attach_kv_tiers"]
