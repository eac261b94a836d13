"""Packed checkpoints: the manifest and every payload file in ONE object, written with ONE request.

Why: on an object store a checkpoint of the multi-file layout (``format.py``) costs two
sequential requests to save (the payload PUT, then the manifest PUT that commits it) and two
to load (the manifest GET, then the payload GET). For small checkpoints the round trips, not
the bytes, are the cost (1 MiB on the local S3 server: 0.59x a raw ``pipe_file``). Packed, a
save is one create-only PUT and a load one GET, the same request count as the raw thing.

Layout: the commit object keeps its name, ``<ckpt dir>/manifest.json``, so everything that
treats "``manifest.json`` exists" as "committed" (listing, pruning, Ray's retention, the
run-dir tools) is unchanged and the directory is still a directory. Its bytes are::

    {"format_version": 3, "packed": true, ..., "files": [{"name", "size", "crc32", "offset"}]}\\n
    <payload bytes of every file, back to back, at their offsets after the newline>

The first line is compact JSON (``json.dumps`` escapes newlines inside strings), so ``head -1
manifest.json`` shows the manifest. A multi-file manifest is indented JSON and starts with
``{`` + newline, never ``{"``, which is how a reader tells the two apart. The single PUT is
create-only (``write_bytes_create_only``), so the commit stays atomic and never overwrites:
a crash before it completes leaves no ``manifest.json``, i.e. an uncommitted directory (on
S3: nothing at all). The PUT carries the object's CRC32 (``ChecksumCRC32``), so S3 verifies
that what it stores is what we serialized. On load the object's length must be exactly
header + newline + the sum of the sizes (truncation, appending), and each file's checksum is
checked before its ``torch.load(weights_only=True)`` result is returned.

Checksums: packed ``format_version`` 3 records a CRC32 per file (``crc32``, 8 hex digits,
zlib's CRC-32); version 2 (still read) recorded a sha256. Why a CRC is sound here: the
checksum exists to detect truncation and bit rot (a flaky disk, a bad transfer, a partial
copy), not tampering. CRC32 is what zip, gzip, PNG and S3's own object checksums use for
exactly that: it catches every burst error of up to 32 bits and every odd number of flipped
bits, and misses random damage with probability 2^-32 (the exact length is checked
separately). It is not a defence against an attacker, but neither was the sha256: whoever can
write a payload can rewrite the manifest with a matching digest. Safety against malicious
files comes from ``torch.load(weights_only=True)``, which refuses anything but tensors and
plain containers whatever the checksum says. What the change buys: 16 MiB costs ~5 ms of CRC32
(it releases the GIL) instead of ~11 ms of sha256, on the save and the load path; and torch's
own zip CRC32 (7.1 vs 2.0 ms per 16 MiB ``torch.save``, never checked by ``torch.load``) is
switched off while we serialize (``checksums.torch_zip_crc_off``).

When: ``should_pack`` says yes when one process holds every file, the storage is not a
local filesystem (local saves stream into an fsync'ed temp file and local loads ``mmap``, both
better for files that fit nowhere but disk) and the tensors total at most ``PACK_MAX_BYTES``
(32 MiB: everything is serialized in memory first, and the checksums must be in the header
before the PUT starts, so they cannot overlap the upload; above that size the multi-file
layout's streamed, multipart, hash-while-sending upload is as fast as raw anyway).
A listing reads only the first ``HEAD_BYTES`` of each ``manifest.json`` (one ranged GET).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from raytrain_events.checkpoint.format.checksums import BATCH, crc32_combine, crc32_hex, hasher, torch_zip_crc_off
from raytrain_events.storage.fs import LocalFileSystem

PACKED_VERSION = 3  # the format_version a packed manifest carries (format.FORMAT_VERSION >= it)
CRC32_SINCE = 3  # from this format_version on a file record may carry crc32 (a packed one must); before, sha256
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


@dataclasses.dataclass
class PackedObject:
    """What ``pack`` made: the files' manifest entries, the object's bytes, their CRC32."""

    entries: list[dict[str, Any]]  # [{name, size, crc32, offset}]
    data: bytes  # header line + payloads: the bytes of manifest.json
    crc32: int  # of all of ``data``: sent with the PUT so the store verifies what we serialized


def pack(files: Mapping[str, Any], header: Callable[[list[dict[str, Any]]], bytes]) -> PackedObject:
    """``torch.save`` each file into memory, checksummed meanwhile; the packed object's bytes.

    ``header(entries)`` gives the compact JSON manifest line for those entries. Each file's
    CRC32 runs on the hashing thread while ``torch.save`` still produces it (torch's own zip
    CRC is off: ours covers the bytes, see ``checksums.torch_zip_crc_off``). The whole
    object's CRC32 is combined from the header's and the files', without another pass.
    ``data`` is ``bytes`` on purpose: a ``bytearray`` body made the PUT 15-25 ms slower at
    16 MiB (s3fs/aiobotocore, measured), more than joining after the CRCs costs."""
    buffers: list[_ChecksumBuffer] = []
    try:
        for obj in files.values():
            buffers.append(_ChecksumBuffer())
            with torch_zip_crc_off():
                torch.save(obj, buffers[-1])
    finally:
        crcs = [b.crc32() for b in buffers]  # waits for the hashing thread (also after a failure)
    entries, offset = [], 0
    for name, buf, crc in zip(files, buffers, crcs):
        entries.append({"name": name, "size": buf.size, "crc32": crc32_hex(crc), "offset": offset})
        offset += buf.size
    line = header(entries) + b"\n"
    data = b"".join([line, *(c for b in buffers for c in b.chunks)])
    total = zlib.crc32(line)
    for buf, crc in zip(buffers, crcs):
        total = crc32_combine(total, crc, buf.size)
    return PackedObject(entries=entries, data=data, crc32=total)


class _ChecksumBuffer:
    """A write-only file for ``torch.save`` that keeps its chunks and CRC32s them, in order,
    on the hashing thread (batched: tiny zip records are not worth a hand-off each)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self._crc = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._last: concurrent.futures.Future | None = None

    def write(self, data: Any) -> int:
        chunk = bytes(data)  # a copy: torch hands us views of its own buffers
        self.chunks.append(chunk)
        self.size += len(chunk)
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= BATCH:
            self._submit()
        return len(chunk)

    def flush(self) -> None:
        pass

    def crc32(self) -> int:
        if self._last is None:  # a small file: done here, a hand-off would cost more
            self._update(self._pending)
            self._pending = []
        self._submit()
        if self._last is not None:
            self._last.result()
        return self._crc

    def _update(self, batch: list[bytes]) -> None:
        for chunk in batch:
            self._crc = zlib.crc32(chunk, self._crc)

    def _submit(self) -> None:
        if not self._pending:
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self._last = hasher().submit(self._update, batch)  # one FIFO thread: in order


def packed_object(manifest: Mapping[str, Any], payloads: Iterable[bytes]) -> bytes:
    """The bytes of a packed ``manifest.json`` from a manifest and payloads: compact JSON line,
    newline, payloads (what ``pack`` makes, without the overlap; for tools and tests)."""
    return b"".join([header_line(manifest), b"\n", *payloads])


def header_line(manifest: Mapping[str, Any]) -> bytes:
    """A packed manifest's first line: compact JSON (``json.dumps`` escapes newlines)."""
    line = json.dumps(dict(manifest), sort_keys=True, separators=(",", ":")).encode()
    assert line.startswith(_PACKED_PREFIX) and b"\n" not in line
    return line
