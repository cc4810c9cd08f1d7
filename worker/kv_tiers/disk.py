"""The disk tier's files: one per disk slot, each the bytes of one KV block with what proves them.

A file is `MAGIC | identity (32) | slot (8) | payload length (8) | sha256 of the payload (32) | payload`.
The identity is a digest of the model, the KV layout and dtype, the block size, the tensor-parallel rank
and a token drawn at start: a file from another model, config, rank or process is foreign. A read returns
the payload only when every field checks and the slot's last write in this process succeeded; anything
else is a miss, logged, never used. Files of an earlier run are removed at start (not reused: the
scheduler that knew what they held is gone with it).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import structlog

log = structlog.get_logger(process="worker")

MAGIC = b"PSKVBLK1"
SUFFIX = ".kvblock"
_HEADER = struct.Struct("<8s32sQQ32s")  # magic, identity, slot, payload length, sha256 of the payload


def identity_digest(fields: dict[str, object]) -> bytes:
    """The 32-byte identity every file carries: a digest of `fields` in a fixed order."""
    return hashlib.sha256(repr(sorted(fields.items())).encode()).digest()


class DiskTier:
    """Reads and writes the block files of one directory. Owns no placement: slots come in the plan."""

    def __init__(self, directory: Path, num_slots: int, block_bytes: int, identity: bytes) -> None:
        self.directory = directory
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.identity = identity
        self._written: set[int] = set()  # slots whose last write succeeded (a failed one left no file)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*" + SUFFIX):
            stale.unlink(missing_ok=True)

    def path(self, slot: int) -> Path:
        return self.directory / f"{slot:08d}{SUFFIX}"

    def write(self, slot: int, payload: bytes) -> bool:
        """Writes the block file of `slot`; False (logged, the slot then reads as a miss) when it fails: a
        full disk is a miss, not an error."""
        self._written.discard(slot)
        path = self.path(slot)
        tmp = path.with_suffix(".tmp")
        header = _HEADER.pack(MAGIC, self.identity, slot, len(payload), hashlib.sha256(payload).digest())
        try:
            path.unlink(missing_ok=True)  # never leave the slot's older block to be read as this one
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kv_disk_write_failed", slot=slot, error=str(e))
            tmp.unlink(missing_ok=True)
            return False
        self._written.add(slot)
        return True

    def read(self, slot: int) -> bytes | None:
        """The payload of `slot`'s file; None (logged) when missing, truncated, corrupt or foreign."""
        problem = None
        data = b""
        if slot not in self._written:
            problem = "not written"
        else:
            try:
                with open(self.path(slot), "rb") as f:
                    data = f.read(_HEADER.size + self.block_bytes + 1)  # a longer file is refused unread
            except OSError as e:
                problem = f"unreadable: {e}"
        if problem is None:
            problem = self._check(slot, data)
        if problem is not None:
            log.warning("kv_disk_read_failed", slot=slot, problem=problem)
            self._written.discard(slot)
            return None
        return data[_HEADER.size :]

    def _check(self, slot: int, data: bytes) -> str | None:
        if len(data) != _HEADER.size + self.block_bytes:
            return f"truncated or padded ({len(data)} bytes)"
        magic, identity, file_slot, length, digest = _HEADER.unpack_from(data)
        if magic != MAGIC or identity != self.identity or file_slot != slot or length != self.block_bytes:
            return "foreign (another format, model, config, process or slot)"
        if hashlib.sha256(memoryview(data)[_HEADER.size :]).digest() != digest:
            return "checksum mismatch"
        return None
