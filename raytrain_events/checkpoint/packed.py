"""Packed checkpoints: the manifest and every payload file in ONE object, written with ONE request.

Why: on an object store a checkpoint of the multi-file layout (``format.py``) costs two
sequential requests to save (the payload PUT, then the manifest PUT that commits it) and two
to load (the manifest GET, then the payload GET). For small checkpoints the round trips, not
the bytes, are the cost (1 MiB on the local S3 server: 0.59x a raw ``pipe_file``). Packed, a
save is one create-only PUT and a load one GET, the same request count as the raw thing.

Layout: the commit object keeps its name, ``<ckpt dir>/manifest.json``, so everything that
treats "``manifest.json`` exists" as "committed" (listing, pruning, Ray's retention, the
run-dir tools) is unchanged and the directory is still a directory. Its bytes are::

    {"format_version": 2, "packed": true, ..., "files": [{"name", "size", "sha256", "offset"}]}\\n
    <payload bytes of every file, back to back, at their offsets after the newline>

The first line is compact JSON (``json.dumps`` escapes newlines inside strings), so ``head -1
manifest.json`` shows the manifest; a multi-file manifest is indented JSON and starts with
``{`` + newline, never ``{"``, which is how a reader tells the two apart. The single PUT is
create-only (``write_bytes_create_only``), so the commit stays atomic and never overwrites:
a crash before it completes leaves no ``manifest.json``, i.e. an uncommitted directory (on
S3: nothing at all). Verification is as for the multi-file layout: the object's length must be
exactly header + newline + the sum of the sizes (truncation), and each file's sha256 is checked
before ``torch.load(weights_only=True)`` reads it (zero-copy, from a view of the buffer).

When: ``should_pack`` says yes when one process holds every file, the storage is not a
local filesystem (local saves stream into an fsync'ed temp file and local loads ``mmap``, both
better for files that fit nowhere but disk) and the tensors total at most ``PACK_MAX_BYTES``
(32 MiB: everything is serialized in memory first, and the sha256 of the payload must be in
the header before the PUT starts, so it cannot overlap the upload; above that size the
multi-file layout's streamed, multipart, hash-while-sending upload is as fast as raw anyway).
A listing reads only the first ``HEAD_BYTES`` of each ``manifest.json`` (one ranged GET).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from raytrain_events.storage.fs import LocalFileSystem

PACKED_VERSION = 2  # the format_version a packed manifest carries (format.FORMAT_VERSION >= it)
PACK_MAX_BYTES = 32 * 2**20
HEAD_BYTES = 256 * 2**10  # what a listing reads of each manifest.json
_PACKED_PREFIX = b'{"'  # a packed manifest's first bytes; a multi-file one starts with b"{\n"


def is_packed(raw: bytes | memoryview) -> bool:
    """Whether the bytes of a ``manifest.json`` (or its first ``HEAD_BYTES``) are a packed one."""
    return bytes(raw[:2]) == _PACKED_PREFIX


def split_header(raw: bytes | memoryview) -> tuple[bytes, int] | None:
    """``(header JSON bytes, offset of the payload)`` of a packed object, None if its first
    line is not all there (a listing's ranged read cut it: read the whole object)."""
    nl = bytes(raw[: min(len(raw), HEAD_BYTES * 64)]).find(b"\n")
    if nl < 0:
        return None
    return bytes(raw[:nl]), nl + 1


def needs_whole(raw: bytes) -> bool:
    """Whether a listing's ranged read of ``HEAD_BYTES`` may have cut the manifest."""
    if len(raw) < HEAD_BYTES:
        return False
    return split_header(raw) is None if is_packed(raw) else True


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list/tuple (an estimate of the serialized size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def should_pack(fs: Any, files: Mapping[str, Any]) -> bool:
    """One process holds all of ``files``: pack them if small and not on a local filesystem."""
    return not isinstance(fs, LocalFileSystem) and tensor_bytes(dict(files)) <= PACK_MAX_BYTES


def pack(files: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """``torch.save`` each file into memory: ([{name, size, sha256, offset}], [payload chunks]).

    Each file is hashed on a helper thread while ``torch.save`` still produces it (sha256
    releases the GIL), so the hash costs little wall time on a machine with a spare core."""
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for name, obj in files.items():
        buf = _HashingBuffer()
        try:
            torch.save(obj, buf)
        finally:
            digest = buf.hexdigest()  # waits for the helper thread (also when torch.save failed)
        entries.append({"name": name, "size": buf.size, "sha256": digest, "offset": offset})
        chunks += buf.chunks
        offset += buf.size
    return entries, chunks


class _HashingBuffer:
    """A write-only file for ``torch.save`` that keeps its chunks and hashes them, in order, on
    one helper thread (batched: tiny zip records are not worth a hand-off each)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self._sha = hashlib.sha256()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._last: concurrent.futures.Future | None = None

    def write(self, data: Any) -> int:
        chunk = bytes(data)  # a copy: torch may reuse the buffer it hands us
        self.chunks.append(chunk)
        self.size += len(chunk)
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= _HASH_BATCH:
            self._submit()
        return len(chunk)

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        if self._last is None:  # a small file: hashed here, a hand-off would cost more
            for chunk in self._pending:
                self._sha.update(chunk)
            self._pending = []
        self._submit()
        if self._last is not None:
            self._last.result()
        return self._sha.hexdigest()

    def _submit(self) -> None:
        if not self._pending:
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self._last = _hasher().submit(lambda: [self._sha.update(c) for c in batch])  # FIFO: in order


_HASH_BATCH = 256 * 2**10  # measured: 1 MiB states pack 0.3 ms faster than with 1 MiB batches
_HASHER: concurrent.futures.ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    """One hashing thread per process, started on first use (never at import)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-ckpt-sha")
        return _HASHER


def sha256_meanwhile(data: Any) -> Callable[[], str]:
    """Start hashing ``data`` (on the hashing thread if it is big); call the result for the hex digest."""
    if memoryview(data).nbytes < _HASH_BATCH:
        digest = hashlib.sha256(data).hexdigest()
        return lambda: digest
    return _hasher().submit(lambda: hashlib.sha256(data).hexdigest()).result


def packed_object(manifest: Mapping[str, Any], payloads: Iterable[bytes]) -> bytes:
    """The bytes of a packed ``manifest.json``: compact JSON line, newline, payloads."""
    header = json.dumps(dict(manifest), sort_keys=True, separators=(",", ":")).encode()
    assert header.startswith(_PACKED_PREFIX) and b"\n" not in header
    return b"".join([header, b"\n", *payloads])
