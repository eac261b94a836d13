"""Reading one committed checkpoint: its manifest, then its files, verified and ``weights_only``-loaded.

The layout and the load paths (mmap for big local files, one GET for packed checkpoints,
concurrent ranged GETs on object stores) are described in ``format.py``; writing is
``writer.py``. Every load first checks the torch floor (``safety.require_safe_torch``).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from raytrain_events.checkpoint.format import packed
from raytrain_events.checkpoint.format.checksums import checksum, checksum_meanwhile
from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.checkpoint.format.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointNotCommittedError,
    FileEntry,
    LoadedCheckpoint,
    UnsafeCheckpointError,
)
from raytrain_events.checkpoint.format.safety import require_safe_torch
from raytrain_events.storage.fs import LocalFileSystem, join, read_bytes, storage_errors, to_url
from raytrain_events.storage.location import Location
from raytrain_events.storage.objectstore import fetch_verified, reader

LOCAL_FS = LocalFileSystem()
_MMAP_MIN_SIZE = 2**20  # smaller local files are read into memory: a mapping costs more there
_MMAP_LOAD = os.name == "posix"  # Windows cannot delete a mapped file (prune would fail)


def read_manifest(ckpt: str | Location, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """The manifest of a committed checkpoint (CheckpointNotCommittedError if there is none).

    ``ckpt``: a URL or a `Location`. Reads the first ``packed.HEAD_BYTES`` of ``manifest.json`` (a
    packed one also holds the payloads), and the rest only if the manifest is longer."""
    where = Location.of(ckpt, storage_options)
    raw = _read_commit_object(where.fs, where.path, head=True)
    return CheckpointInfo.from_manifest(where.url, raw)


def _read_commit_object(fs: Any, path: str, *, head: bool = False) -> bytes:
    """The bytes of ``<path>/manifest.json`` (with ``head``: its first ``HEAD_BYTES`` or more)."""
    manifest = join(path, MANIFEST)
    try:
        if head:
            raw = read_bytes(fs, manifest, size_hint=packed.HEAD_BYTES, end=packed.HEAD_BYTES)
            if not packed.needs_whole(raw):
                return raw
        return read_bytes(fs, manifest, single_get=True)  # packed: at most ~PACK_MAX_BYTES
    except FileNotFoundError:
        raise CheckpointNotCommittedError(
            f"{to_url(fs, path)!r} has no {MANIFEST}: the checkpoint was never committed (its "
            "save crashed or is still running) or the URL is wrong. Fix: use "
            "latest_checkpoint() / load_latest_valid() to find a committed checkpoint."
        ) from None


def read_checkpoint(
    ckpt: str | Location,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    map_location: Any = "cpu",
    local: LocalCopies | None = None,
) -> LoadedCheckpoint:
    """Verify and load a committed checkpoint (all files, or only those named in ``files``; ``ckpt``: a
    URL or a `Location`, resolved once for the manifest and every file).

    One GET of ``manifest.json`` (no HEAD: its size is bounded): a packed checkpoint is then
    all here; a multi-file one fetches its files next. With ``local`` (the node-local tier), the
    manifest's head is read instead, and each file comes from the local copy where it matches."""
    where = Location.of(ckpt, storage_options)
    if local is not None:
        return _read_files(where, read_manifest(where), _wanted_names(files), map_location, local)
    raw = _read_commit_object(where.fs, where.path)
    info = CheckpointInfo.from_manifest(where.url, raw)
    if info.packed:
        return LoadedCheckpoint(info=info, files=_load_packed(info, raw, _wanted(info, files), map_location))
    return _read_files(where, info, _wanted_names(files), map_location)


def read_checkpoint_files(
    info: CheckpointInfo,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    map_location: Any = "cpu",
    local: LocalCopies | None = None,
) -> LoadedCheckpoint:
    """``read_checkpoint`` for a manifest already read (``read_manifest``, ``list_checkpoints``).

    If the checkpoint was deleted since, its missing files raise CheckpointCorruptError. ``local``: the
    node-local copy to read each file from where it matches the manifest (else storage is read)."""
    return _read_files(Location.of(info.url, storage_options), info, _wanted_names(files), map_location, local)


def _wanted_names(files: Iterable[str] | None) -> list[str] | None:
    return None if files is None else list(files)


def _read_files(
    where: Location,
    info: CheckpointInfo,
    names: list[str] | None,
    map_location: Any,
    local: LocalCopies | None = None,
) -> LoadedCheckpoint:
    wanted = _wanted(info, names)
    out: dict[str, Any] = {}
    if local is not None:  # the node-local tier first, each file verified against the committed manifest
        for e in wanted:
            if os.path.exists(local.path(e.name)):
                try:
                    out[e.name] = _load_verified(LOCAL_FS, local.path(e.name), info.url, e, map_location)
                    local.local.append(e.name)
                    continue
                except (CheckpointCorruptError, OSError) as err:  # corrupt, truncated, unreadable: storage
                    local.fell_back(e.name, str(err))
            else:
                local.fell_back(e.name, "no local copy")
        wanted = [e for e in wanted if e.name not in out]
        if not wanted:
            return LoadedCheckpoint(info=info, files=out)
    loaded = _read_from_storage(where, info, wanted, map_location)
    loaded.files.update(out)
    return loaded


def _read_from_storage(
    where: Location, info: CheckpointInfo, wanted: list[FileEntry], map_location: Any
) -> LoadedCheckpoint:
    if info.packed:  # one GET of the whole object, its size known: no HEAD
        try:
            raw = _read_commit_object(where.fs, where.path)
        except CheckpointNotCommittedError:
            raise CheckpointCorruptError(
                f"Checkpoint {info.url!r} was deleted since it was listed. Fix: load an older checkpoint."
            ) from None
        return LoadedCheckpoint(info=info, files=_load_packed(info, raw, wanted, map_location))
    loaded = {e.name: _load_verified(where.fs, where.child(e.name).path, info.url, e, map_location) for e in wanted}
    return LoadedCheckpoint(info=info, files=loaded)


def _wanted(info: CheckpointInfo, files: Iterable[str] | None) -> list[FileEntry]:
    by_name = {f.name: f for f in info.files}
    wanted = list(by_name) if files is None else list(files)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise KeyError(
            f"Checkpoint {info.url!r} has no file(s) {unknown}; it has {sorted(by_name)}. Fix: ask for one of those."
        )
    return [by_name[n] for n in wanted]


def _load_packed(info: CheckpointInfo, raw: bytes, wanted: list[FileEntry], map_location: Any) -> dict[str, Any]:
    """Verify the packed object's length and each wanted file's checksum, and ``torch.load`` it.

    A big file's checksum (crc32; sha256 in version 2) runs on the hashing thread while ``torch.load(weights_only=True)``
    reads it; its result is returned only if the digest matches, and a mismatch is reported
    (as corruption) even when the load failed too. Reading unverified bytes is safe: safety
    comes from ``weights_only`` (see the module docstring), the checksums catch bit rot."""
    where = f"{MANIFEST} of checkpoint {info.url!r}"
    fix = "Fix: load an older checkpoint (load_latest_valid does this) and delete this one."
    if len(raw) != info.packed_size:
        raise CheckpointCorruptError(
            f"The packed {where} is corrupt: expected {info.packed_size} bytes (header + files), "
            f"got {len(raw)} (truncated or appended to). {fix}"
        )
    start = info.packed_size - sum(f.size for f in info.files)
    view = memoryview(raw)
    out = {}
    for e in wanted:
        part = view[start + e.offset : start + e.offset + e.size]
        algorithm, expected = e.checksum
        digest = checksum_meanwhile(algorithm, part)

        def check(e: FileEntry = e, algorithm: str = algorithm, expected: str = expected, digest: Any = digest) -> None:
            if digest() != expected:
                raise CheckpointCorruptError(
                    f"File {e.name!r} packed in the {where} is corrupt: expected {algorithm} {expected}, "
                    f"got {digest()}. {fix}"
                )

        try:
            out[e.name] = _torch_load(reader(part), info.url, e, map_location)
        except Exception:
            check()  # corruption explains a failed load: report that
            raise
        check()
    return out


def _load_verified(fs: Any, path: str, url: str, entry: FileEntry, map_location: Any) -> Any:
    algorithm, expected = entry.checksum
    mapped = _MMAP_LOAD and isinstance(fs, LocalFileSystem) and entry.size >= _MMAP_MIN_SIZE
    try:
        if mapped:  # see the module docstring
            with storage_errors("reading", path), open(path, "rb") as f:
                size, digest, is_zip = os.fstat(f.fileno()).st_size, None, False
                if size == entry.size:  # the size check comes before mapping or hashing
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                        digest, is_zip = checksum(algorithm, m), m[:4] == b"PK\x03\x04"
        else:  # object stores: checksummed while the ranges arrive
            data, size, digest = fetch_verified(fs, path, entry.size, algorithm)
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"File {entry.name!r} listed in the manifest of {url!r} is missing. Fix: load an older checkpoint."
        ) from None
    if size != entry.size or digest != expected:
        got = f"{size} bytes" + (f" with {algorithm} {digest}" if digest else "")
        raise CheckpointCorruptError(
            f"File {entry.name!r} of checkpoint {url!r} is corrupt: expected {entry.size} bytes "
            f"with {algorithm} {expected}, got {got}. Fix: load an older checkpoint "
            "(load_latest_valid does this) and delete this one."
        )
    if not mapped:
        return _torch_load(reader(data), url, entry, map_location)
    if not is_zip:  # not torch.save's zip format (ours always is): mmap=True would refuse it
        return _torch_load(io.BytesIO(read_bytes(fs, path)), url, entry, map_location)
    return _torch_load(path, url, entry, map_location, mmap=True)


def _torch_load(f: Any, url: str, entry: FileEntry, map_location: Any, **kw: Any) -> Any:
    require_safe_torch(f"checkpoint {url!r}")
    try:
        return torch.load(f, weights_only=True, map_location=map_location, **kw)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"Refused to load {entry.name!r} from checkpoint {url!r}: it asks torch's "
            f"weights-only unpickler for something outside its allowlist ({refusal_reason(e)}). "
            "Nothing in the file was executed. Checkpoints written by raytrain_events never "
            "need this, so the file was written by other code or tampered with (its checksum "
            "matching proves nothing: the manifest can be rewritten too). Fix: only if you trust "
            "its origin, load it yourself with torch.load(..., weights_only=False) or allowlist "
            "the classes with torch.serialization.add_safe_globals([...])."
        ) from e


def refusal_reason(err: Exception) -> str:
    skip = (
        "Weights only load failed",
        "Check the documentation",
        "Please file an issue",
        "In PyTorch 2.6",
        "Re-running",
    )
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(skip)]
    return "; ".join(useful) or (lines[0] if lines else type(err).__name__)
