"""The tier manager: where every evicted prefix block lives below the GPU pool, and the copies that move it.

The block manager calls `evicted` when a cached GPU block (ref count 0) is taken for new content, and asks
`walk` what of a prefix lies below the GPU; it calls `load` for each block it brings back into a fresh GPU
block. Everything the worker must copy collects here while a plan is built and leaves with it
(`take_transfers`); the worker applies them first, in this order: disk writes (host slot -> file), offloads
(GPU block -> host slot), disk reads (file -> host slot), loads (host slot -> GPU block). Slots a plan
touches are pinned until it is sent, so within a plan no slot is written after it is read or written twice.

Host memory is inclusive of what it loaded (a block brought back keeps its host copy: evicted again, it
costs no copy) and so is disk of what it read. A disk read is not trusted until the worker answers the plan
that carried it: the host slot lands, and only `confirm` (no failure reported) makes it a hit; a failed read
(a corrupt, truncated or foreign file, or a write that never happened) forgets the disk copy, a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.scheduler.kv_tiers.pool import TierPool

log = structlog.get_logger(process="scheduler")


class Where(Enum):
    HOST = "host"  # in host memory: loadable in this plan
    DISK = "disk"  # on disk: must be read into host memory first
    LANDING = "landing"  # a disk read in flight: wait for it


@dataclass
class Transfers:
    """The copies of one plan, in the order the worker applies them."""

    disk_writes: list[tuple[int, int]] = field(default_factory=list)  # (host slot, disk slot)
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, host slot)
    disk_reads: list[tuple[int, int]] = field(default_factory=list)  # (disk slot, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, gpu block)


@dataclass
class TierCounters:
    """Totals since start, for /metrics (per tier)."""

    host_hits: int = 0  # blocks a new sequence found in host memory and loaded
    disk_hits: int = 0  # blocks found on disk and read into host memory
    offloads: int = 0  # GPU blocks copied to host memory on eviction
    disk_writes: int = 0  # host blocks written to disk on eviction
    disk_read_failures: int = 0  # disk reads the worker refused (a miss)
    dropped: int = 0  # evicted blocks no tier could take (every slot pinned)


class TierManager:
    """Owns the host and disk tiers' slots; the block manager owns the GPU pool and calls in."""

    def __init__(self, num_host_blocks: int, num_disk_blocks: int = 0, block_bytes: int = 0) -> None:
        if num_host_blocks < 1:
            raise ValueError("the host tier needs at least one block (the disk tier is read through it)")
        self.host = TierPool(num_host_blocks, "CPU")
        self.disk = TierPool(num_disk_blocks, "DISK") if num_disk_blocks > 0 else None
        self.counters = TierCounters()
        self.block_bytes = block_bytes  # one block's bytes (0: not announced), for the metrics
        self._transfers = Transfers()
        self._waited: set[int] = set()  # seq ids that waited for disk reads once (they wait no more)
        # step id -> the disk reads its plan carries: (host slot, hash, disk slot)
        self._landing: dict[int, list[tuple[int, bytes, int]]] = {}
        self._pending: list[tuple[int, bytes, int]] = []  # disk reads of the plan being built
        self._landing_hashes: set[bytes] = set()

    # ----------------------------------------------------------------------------------------------------
    # the block manager's calls

    def evicted(self, block_id: int, h: bytes) -> None:
        """The GPU block `block_id`, holding `h`, is about to be overwritten: keep its content below."""
        if self.host.lookup(h) is not None or h in self._landing_hashes:
            return  # host memory has it already (inclusive)
        slot = self._host_slot()
        if slot is None:
            self.counters.dropped += 1
            return
        self.host.store(slot, h)
        self._transfers.offloads.append((block_id, slot))
        self.counters.offloads += 1

    def walk(self, hashes: list[bytes]) -> list[Where]:
        """Where each of the leading `hashes` lies below the GPU, up to the first that is nowhere."""
        found = []
        for h in hashes:
            if h in self.host:
                found.append(Where.HOST)
            elif h in self._landing_hashes:
                found.append(Where.LANDING)
            elif self.disk is not None and h in self.disk:
                found.append(Where.DISK)
            else:
                break
        return found

    def host_prefix(self, seq_id: int, hashes: list[bytes]) -> list[bytes] | None:
        """The leading `hashes` a new sequence can load from host memory now, or None when it should wait
        for disk reads of its prefix first. Starts those reads (once per sequence: after one wait it takes
        what host memory holds, so that evictions racing its reads cannot keep it waiting)."""
        found = self.walk(hashes)
        if seq_id not in self._waited and (Where.DISK in found or Where.LANDING in found):
            self._waited.add(seq_id)
            for h, where in zip(hashes, found, strict=False):
                if where is Where.DISK and not self._read(h):
                    break
            return None
        return hashes[: _leading(found, Where.HOST)]

    def load(self, h: bytes, block_id: int) -> None:
        """Host memory's copy of `h` goes into the fresh GPU block `block_id` in this plan."""
        slot = self.host.lookup(h)
        assert slot is not None, "load of a block host memory does not hold"
        self.host.pin(slot)
        self._transfers.loads.append((slot, block_id))
        self.counters.host_hits += 1

    def pin(self, hashes: list[bytes]) -> None:
        """Keeps these host blocks (to be loaded in this plan) from eviction by the blocks the load takes."""
        for h in hashes:
            slot = self.host.lookup(h)
            assert slot is not None
            self.host.pin(slot)

    def forget(self, seq_id: int) -> None:
        """The sequence was admitted or freed."""
        self._waited.discard(seq_id)

    # ----------------------------------------------------------------------------------------------------
    # the plan and its answer

    def take_transfers(self, step_id: int) -> Transfers:
        """The copies of the plan `step_id`, which is about to be sent; starts the next plan's."""
        transfers, self._transfers = self._transfers, Transfers()
        if self._pending:
            self._landing[step_id] = self._pending
            self._pending = []
        self.host.end_step()
        if self.disk is not None:
            self.disk.end_step()
        return transfers

    def confirm(self, step_id: int, failed_host_slots: list[int]) -> None:
        """The worker answered plan `step_id`: its disk reads landed, but those into `failed_host_slots`."""
        failed = set(failed_host_slots)
        for slot, h, disk_slot in self._landing.pop(step_id, ()):
            self._landing_hashes.discard(h)
            if slot in failed:
                self.host.release(slot)
                assert self.disk is not None
                if h in self.disk:
                    self.disk.remove(h)
                self.counters.disk_read_failures += 1
                log.warning("kv_disk_read_failed", host_slot=slot, disk_slot=disk_slot)
            else:
                self.host.store(slot, h)  # most recently used: its sequence is about to load it

    # ----------------------------------------------------------------------------------------------------

    def _host_slot(self) -> int | None:
        """A host slot to write into this plan; its evicted block goes to disk first, when there is one."""
        reserved = self.host.reserve()
        if reserved is None:
            return None
        slot, old = reserved
        if old is not None and self.disk is not None and self.disk.lookup(old) is None:
            disk_reserved = self.disk.reserve()
            if disk_reserved is not None:
                disk_slot, _ = disk_reserved  # a disk block that falls off the end is gone
                self.disk.store(disk_slot, old)
                self._transfers.disk_writes.append((slot, disk_slot))
                self.counters.disk_writes += 1
        return slot

    def _read(self, h: bytes) -> bool:
        """Starts the read of `h` from disk into a host slot; False when no host slot is free to take it."""
        assert self.disk is not None
        disk_slot = self.disk.lookup(h)
        if disk_slot is None:
            return False  # a disk write for an earlier read of this walk took its slot
        self.disk.pin(disk_slot)  # before the host slot's eviction may write to disk
        slot = self._host_slot()
        if slot is None:
            return False
        self.host.land(slot)
        self._landing_hashes.add(h)
        self._pending.append((slot, h, disk_slot))
        self._transfers.disk_reads.append((disk_slot, slot))
        self.counters.disk_hits += 1
        return True

    def metrics(self) -> dict[str, tuple[float, str, str]]:
        """Prometheus samples of the tiers: name -> (value, type, help)."""
        c = self.counters
        out = {
            "pagedserve_kv_host_tier_blocks": (
                self.host.num_cached,
                "gauge",
                "KV blocks held in host memory",
            ),
            "pagedserve_kv_host_tier_capacity_blocks": (
                self.host.num_slots,
                "gauge",
                "Host tier size, blocks",
            ),
            "pagedserve_kv_host_tier_hits_total": (
                c.host_hits,
                "counter",
                "Blocks loaded back from host memory",
            ),
            "pagedserve_kv_host_tier_stores_total": (
                c.offloads,
                "counter",
                "GPU blocks offloaded to host memory",
            ),
            "pagedserve_kv_host_tier_bytes": (
                self.host.num_cached * self.block_bytes,
                "gauge",
                "Bytes of KV held in host memory",
            ),
            "pagedserve_kv_tier_dropped_total": (c.dropped, "counter", "Evicted blocks no tier could take"),
        }
        if self.disk is not None:
            out |= {
                "pagedserve_kv_disk_tier_blocks": (self.disk.num_cached, "gauge", "KV blocks held on disk"),
                "pagedserve_kv_disk_tier_bytes": (
                    self.disk.num_cached * self.block_bytes,
                    "gauge",
                    "Bytes of KV held on disk",
                ),
                "pagedserve_kv_disk_tier_capacity_blocks": (self.disk.num_slots, "gauge", "Disk tier size"),
                "pagedserve_kv_disk_tier_hits_total": (c.disk_hits, "counter", "Blocks read back from disk"),
                "pagedserve_kv_disk_tier_stores_total": (c.disk_writes, "counter", "Blocks written to disk"),
                "pagedserve_kv_disk_tier_read_failures_total": (
                    c.disk_read_failures,
                    "counter",
                    "Disk reads refused (missing, corrupt, truncated or foreign file): misses",
                ),
            }
        return out

    def families(self) -> list[Metric]:
        """The tiers' metrics as Prometheus families (common/exposition.py renders them)."""
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        return [kinds[kind](name, text, value=value) for name, (value, kind, text) in self.metrics().items()]

    def check_invariants(self) -> None:
        """Raises AssertionError when a tier's bookkeeping is inconsistent."""
        self.host.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
        landing = [h for reads in (*self._landing.values(), self._pending) for _, h, _ in reads]
        assert set(landing) == self._landing_hashes and len(landing) == len(set(landing)), "landing hashes"
        assert not any(h in self.host for h in landing), "a landing block is also cached in host memory"


def _leading(found: list[Where], where: Where) -> int:
    n = 0
    while n < len(found) and found[n] is where:
        n += 1
    return n
