"""The manifest of a checkpoint: its data model, parsing (both layouts) and input checks.

Split from ``format.py`` (which writes and reads checkpoints) so each stays one job; the names
here are re-exported there. ``CheckpointInfo.from_manifest`` reads the indented JSON of a
multi-file checkpoint (format_version 4: a crc32 per file; 1: a sha256 per file) and the first
line of a packed one (format_version 3: a crc32 per file; 2: a sha256 per file; see
``packed.py``), and refuses a newer format_version with the version that wrote it. From
version 3 on a file record carries ``crc32`` or, if it has none, ``sha256`` (``FileEntry``s
that callers of ``commit_checkpoint`` made themselves with hashlib).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from raytrain_events.checkpoint.format import packed
from raytrain_events.storage.fs import basename

FORMAT_VERSION = 4  # the newest this library reads and writes (see MULTI_FILE_VERSION, packed.PACKED_VERSION)
MULTI_FILE_VERSION = 4  # multi-file with crc32 records (4 and not 3: readers of 1..3 took 3 as packed-only)
MANIFEST = "manifest.json"
CHECKPOINT_NAME_RE = re.compile(r"^ckpt-(\d{12})-([0-9a-f]{8})$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CRC32_RE = re.compile(r"^[0-9a-f]{8}$")


class CheckpointError(Exception):
    """Base class for checkpoint format errors."""


class CheckpointNotCommittedError(CheckpointError):
    """The directory has no manifest: the save crashed, is still running, or the URL is wrong."""


class CheckpointCorruptError(CheckpointError):
    """A file is missing, has the wrong size or checksum, or the manifest is unreadable."""


class UnsupportedCheckpointVersionError(CheckpointError):
    """Written by a newer (or unknown) format version than this library reads."""


class UnsafeCheckpointError(CheckpointError):
    """``torch.load(weights_only=True)`` refused the file; nothing in it was executed."""


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its checksum is ``crc32`` (8 hex digits; ``sha256`` is then "")
    or ``sha256`` (format_version 1 and 2, and entries a caller made with hashlib); see ``checksum``."""

    name: str
    size: int
    sha256: str
    offset: int = -1  # packed checkpoints: where the file starts after the header line
    crc32: str = ""  # 8 hex digits (zlib.crc32)

    @property
    def checksum(self) -> tuple[str, str]:
        """``(algorithm, hex digest)`` that verifies this file."""
        return ("crc32", self.crc32) if self.crc32 else ("sha256", self.sha256)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as described by its manifest."""

    url: str
    name: str
    format_version: int
    library_version: str
    created: float
    timestamp: dict[str, int]
    world_size: int
    metadata: dict[str, Any]
    files: tuple[FileEntry, ...]
    packed_size: int = -1  # packed checkpoints (packed.py): bytes of the whole manifest.json

    @property
    def batch(self) -> int:
        return int(self.timestamp.get("batch", -1))

    @property
    def packed(self) -> bool:
        return self.packed_size >= 0

    def manifest(self) -> dict[str, Any]:
        def entry(f: FileEntry) -> dict[str, Any]:
            out: dict[str, Any] = {"name": f.name, "size": f.size, f.checksum[0]: f.checksum[1]}
            return {**out, "offset": f.offset} if self.packed else out

        return {
            "format_version": self.format_version,
            "library_version": self.library_version,
            "created": self.created,
            "timestamp": self.timestamp,
            "world_size": self.world_size,
            "metadata": self.metadata,
            "files": [entry(f) for f in self.files],
            **({"packed": True} if self.packed else {}),
        }

    @classmethod
    def from_manifest(cls, url: str, raw: bytes) -> CheckpointInfo:
        """Parse a ``manifest.json`` (or, packed, at least its first line; see packed.py)."""
        header = (packed.split_header(raw) if packed.is_packed(raw) else None) or (raw, -1)
        try:
            m = json.loads(header[0])  # compact JSON without a newline is a plain manifest
            version = int(m["format_version"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(
                f"Manifest of checkpoint {url!r} is unreadable ({type(e).__name__}: {e}). "
                "Fix: load an older checkpoint (load_latest_valid does this) and delete this one."
            ) from e
        if version > FORMAT_VERSION or version < 1:
            raise UnsupportedCheckpointVersionError(
                f"Checkpoint {url!r} has format_version {version}, but this raytrain_events "
                f"({_library_version()}) reads format_version 1..{FORMAT_VERSION}. Fix: "
                "upgrade raytrain_events to the version that wrote it "
                f"({m.get('library_version', 'unknown')})."
            )
        try:
            is_packed = header[1] >= 0
            if is_packed != bool(m.get("packed", False)):
                raise ValueError("the layout of manifest.json does not match its 'packed' field")
            files = tuple(_file_entry(f, is_packed, version) for f in m["files"])
            total = sum(f.size for f in files)
            if is_packed and any(f.offset < 0 or f.size < 0 or f.offset + f.size > total for f in files):
                raise ValueError("a packed file's offset/size lies outside the payload")
            return cls(
                url=url,
                name=basename(url),
                format_version=version,
                library_version=str(m["library_version"]),
                created=float(m["created"]),
                timestamp={str(k): int(v) for k, v in m["timestamp"].items()},
                world_size=int(m["world_size"]),
                metadata=dict(m["metadata"]),
                files=files,
                packed_size=header[1] + total if is_packed else -1,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(
                f"Manifest of checkpoint {url!r} is missing or has a malformed field "
                f"({type(e).__name__}: {e}). Fix: load an older checkpoint and delete this one."
            ) from e


def _file_entry(f: Mapping[str, Any], is_packed: bool, version: int) -> FileEntry:
    """A manifest's file record: from version 3 on ``crc32`` (required when packed) or ``sha256``;
    before, ``sha256``."""
    offset = int(f["offset"]) if is_packed else -1
    if version >= packed.CRC32_SINCE and (is_packed or "crc32" in f):
        crc = str(f["crc32"])
        if not _CRC32_RE.match(crc):
            raise ValueError(f"crc32 of {f['name']!r} is {crc!r}, not 8 lowercase hex digits")
        return FileEntry(str(f["name"]), int(f["size"]), "", offset, crc)
    return FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"]), offset)


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    info: CheckpointInfo
    files: dict[str, Any]


def checkpoint_name(timestamp: Mapping[str, int], token: str | None = None) -> str:
    """``ckpt-<batch:012d>-<id8>``: sorts by batch, unique across retries of one batch.

    ``id8`` is random, or, with ``token``, derived from it: ranks that share a token (agreed
    once at set-up) and count their saves alike name the directory the same without talking."""
    suffix = hashlib.sha256(token.encode()).hexdigest()[:8] if token is not None else uuid.uuid4().hex[:8]
    return f"ckpt-{int(timestamp.get('batch', 0)):012d}-{suffix}"


def _check_file_name(name: str) -> str:
    if name == MANIFEST or not _FILE_NAME_RE.match(name or ""):
        raise ValueError(
            f"Invalid checkpoint file/directory name {name!r}. Fix: use letters, "
            f"digits, '.', '_' or '-' (no '/'), and not {MANIFEST!r}."
        )
    return name


def _check_timestamp(timestamp: Mapping[str, int]) -> dict[str, int]:
    bad = {k: v for k, v in timestamp.items() if type(v) is not int or not isinstance(k, str)}
    if bad:
        raise TypeError(
            f"Checkpoint timestamp must map str to plain int; bad entries: {bad!r}. "
            "Fix: pass e.g. {'epoch': 1, 'batch': 500} (use int(...) on tensors)."
        )
    return dict(timestamp)


def _check_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"Checkpoint metadata must be JSON-serializable ({e}). Fix: convert "
            "values to str/int/float/bool/None/lists/dicts first."
        ) from e


def _library_version() -> str:
    return str(getattr(sys.modules.get("raytrain_events"), "__version__", "0"))
