"""A full checkpoint's ``state.pt`` on every node's local tier, from rank 0 over the process group at a restart.

A full (unsharded) checkpoint's ``state.pt`` is written by rank 0 alone, so only rank 0's node keeps it in its
local tier (``CheckpointConfig(local_dir=...)``); without this, the ranks of every other node read the whole file
from object storage at a restart, and the restart waits for the slowest of those reads: for a run of several nodes
the tier saved nothing on the restart's critical path. Here, when the ranks load the same checkpoint
(`read_latest_shared`), each says whether its node holds a copy that matches the committed manifest (size and
CRC32); if rank 0's does and some other's does not, rank 0 sends the file's bytes to every rank over the run's
gloo group (a broadcast in 64 MiB chunks) and each rank that lacked it writes them into its node's tier
(atomically: temp file, checked against the manifest, renamed), where its read then finds them. Object storage
stays the source of truth: the bytes are checked against its manifest before they are kept, and a rank whose copy
fails the check reads storage as before.

Why at load and not at each save: every save would cost each other node a copy of the whole state (its own
host copy and ``torch.save``, which must come out byte-identical to rank 0's to match the manifest, or a
download from storage, ``nodes - 1`` reads of the state per save), for restarts that may never come. Here a save
costs nothing more, and a restart costs one broadcast of ``state.pt`` (the cluster network, pipelined by gloo)
instead of ``nodes - 1`` reads from storage; the next restart finds the copy on every node as long as the
checkpoint is still the newest. Checked (size + CRC32 of the local file) on every rank, one small all-gather.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import Any, Optional

import torch

from raytrain_events.checkpoint.format.checksums import checksum
from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.checkpoint.format.manifest import CheckpointInfo, FileEntry
from raytrain_events.storage.crc32 import new_checksum
from raytrain_events.storage.fs import local_atomic_writer
from raytrain_events.storage.run_dir import STATE_FILE

__all__ = ["CHUNK_BYTES", "fill_from_rank0", "matches"]

_log = logging.getLogger(__name__)

#: Bytes per broadcast of the fill (each rank holds one chunk at a time, not the whole file).
CHUNK_BYTES = 64 * 2**20


def matches(path: str, entry: FileEntry) -> bool:
    """Whether ``path`` holds the file ``entry`` of the committed manifest (its size, then its checksum)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.size:
                return False
            algorithm, expected = entry.checksum
            if size == 0:
                return checksum(algorithm, b"") == expected
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return checksum(algorithm, m) == expected
    except OSError:
        return False


def fill_from_rank0(dist: Any, rank: int, info: CheckpointInfo, local: Optional[LocalCopies]) -> int:
    """Every rank (a collective): give the ranks whose node lacks ``info``'s ``state.pt`` rank 0's copy (see the
    module doc). Returns the bytes this rank kept in its node's tier (0: it had the copy, or none was sent)."""
    entry = next((e for e in info.files if e.name == STATE_FILE), None)
    if entry is None or info.packed or not dist.is_distributed:
        return 0  # a packed checkpoint is one small object (its manifest.json), read from storage by design
    path = None if local is None else local.path(STATE_FILE)
    have = path is not None and matches(path, entry)
    flags = dist.all_gather_object((have, local is not None))
    if not flags[0][0] or all(has or not tiered for has, tiered in flags):
        return 0  # rank 0's node has no copy to give, or every rank with a tier has one
    take = path is not None and not have
    algorithm, expected = entry.checksum
    digest = new_checksum(algorithm)
    try:
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(open(path, "rb")) if rank == 0 else None  # type: ignore[arg-type]
            dst = stack.enter_context(local_atomic_writer(path)) if take else None  # type: ignore[arg-type]
            for offset in range(0, entry.size, CHUNK_BYTES):
                n = min(CHUNK_BYTES, entry.size - offset)
                chunk = torch.frombuffer(bytearray(src.read(n)), dtype=torch.uint8) if src is not None else None
                chunk = chunk if chunk is not None else torch.empty(n, dtype=torch.uint8)
                torch.distributed.broadcast(chunk, src=0, group=getattr(dist, "gloo_group", None))
                if dst is not None:
                    data = memoryview(chunk.numpy())
                    digest.update(data)
                    dst.write(data)
            if dst is not None and digest.hexdigest() != expected:  # the writer drops its temp file: nothing kept
                raise _Mismatch(f"{algorithm} {digest.hexdigest()}, the manifest says {expected}")
    except _Mismatch as e:
        _log.warning(
            "Local tier: the %s rank 0 sent does not match the manifest (%s); storage serves it.", STATE_FILE, e
        )
        return 0
    if not take:
        return 0
    _log.info("Local tier: %s (%d bytes) from rank 0 into %s", STATE_FILE, entry.size, path)
    return entry.size


class _Mismatch(Exception):
    """The bytes rank 0 sent do not match the committed manifest."""
