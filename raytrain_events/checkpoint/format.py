"""On-storage checkpoint format: one new directory per checkpoint, committed by its manifest.

Layout (any fsspec URL: local path, ``memory://``, ``s3://``...), multi-file (format_version 4;
1 is still read)::

    <root>/ckpt-<batch:012d>-<uuid8>/      sortable by name; never overwritten
        state.pt, rng-rank0.pt, ...        torch.save bytes, each uploaded atomically
        manifest.json                      written LAST, create-only: its presence = committed

or packed (format_version 3, ``packed.py``; 2 is still read): the directory holds only ``manifest.json``, whose
first line is the manifest and the rest the files' bytes, written by ONE create-only request
(``write_packed_checkpoint``). ``write_checkpoint`` packs small checkpoints held by one process
on object stores (``packed.should_pack``): a save is then one PUT and a load one GET instead
of two sequential requests each. Readers take both layouts; the manifest model and its parsing
live in ``manifest.py`` (re-exported here).

Why: a reader that sees ``manifest.json`` sees every payload file complete, and a crash at
any point before it leaves only an uncommitted directory that ``list_checkpoints`` ignores,
so the previous checkpoint stays ``latest`` and loadable. The manifest records
``format_version`` (``FORMAT_VERSION``), the library version, creation time, the caller's
``timestamp`` dict (plain ints), ``world_size``, free-form JSON ``metadata`` and, per file,
its name, size and checksum (detects truncation and bit rot): CRC32 (``packed.py`` says why
that is enough; versions 1 and 2, still read, recorded sha256s, and are still written, as 1,
when every ``FileEntry`` a caller commits carries a sha256).

Why ``torch.save`` + ``torch.load(weights_only=True)`` and not torch.distributed.checkpoint:
DCP reads its ``.metadata`` with plain ``pickle`` (code execution on load), and for DDP the
replicated state is written once by rank 0 anyway. Safety comes from ``weights_only``, NOT
from the checksums: whoever can write a payload can rewrite the manifest too.

Several ranks: rank 0 picks the URL (``new_checkpoint_url``) and broadcasts it; every rank r
uploads its own ``rng_file_name(r)`` with ``write_checkpoint_file`` and sends the returned
``FileEntry`` to rank 0, which uploads its files and calls ``commit_checkpoint`` with all
entries. ``write_checkpoint`` does all of that for one process.

I/O paths (the bytes on storage are the same either way; our ``torch.save`` calls skip torch's
zip CRC32, ``checksums.torch_zip_crc_off``, as ours covers the bytes):

* Save, local: ``torch.save`` streams into the temp file, CRC32ed on the way, then fsync +
  rename (``local_atomic_writer``). Object stores: ``torch.save`` streams into
  ``storage.objectstore.open_upload``: below two parts one PUT carrying the CRC32; above, a
  multipart upload whose parts go up in parallel with their CRC32s, completed (or aborted)
  before the manifest.
* Load, local files >= 1 MiB on POSIX: size check, checksum over an ``mmap``, then
  ``torch.load(path, mmap=True)``: no read copy; tensors are copy-on-write (``MAP_PRIVATE``)
  views of the page cache, copied when ``load_state_dict`` copies from them or written to.
  Sound because checkpoint files are never rewritten in place (temp file + rename, a new
  directory per checkpoint), and deleting a mapped file (pruning) leaves the mapping valid on
  POSIX. Windows cannot delete a mapped file, so there (and for small files) the file is read
  into memory, as on object stores. Caveat: on a network filesystem a deletion by ANOTHER host
  can make not-yet-read pages unreadable; the Trainer copies weights out at once and the first
  step rewrites optimizer state, so only state a run never touches stays mapped.
* Load, packed: one plain GET of ``manifest.json`` (no HEAD), the length and each file's
  checksum checked, ``torch.load`` from views of that buffer (no copy). A listing reads the
  first ``packed.HEAD_BYTES`` of each manifest (one ranged GET each, concurrent).
* Load, object stores: ``storage.objectstore.fetch_verified``: no HEAD, concurrent ranged GETs
  into one buffer that ``torch.load`` reads without a copy, checksummed in order as ranges
  arrive; a wrong size is seen from the first response's headers.
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import pickle
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from raytrain_events.checkpoint import packed
from raytrain_events.checkpoint.checksums import checksum, checksum_meanwhile, torch_zip_crc_off
from raytrain_events.checkpoint.manifest import (
    CHECKPOINT_NAME_RE as CHECKPOINT_NAME_RE,  # re-exported
)
from raytrain_events.checkpoint.manifest import (
    FORMAT_VERSION as FORMAT_VERSION,  # re-exported
)
from raytrain_events.checkpoint.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotCommittedError,
    FileEntry,
    LoadedCheckpoint,
    UnsafeCheckpointError,
    _check_file_name,
    _check_metadata,
    _check_timestamp,
    _library_version,
    checkpoint_name,
)
from raytrain_events.checkpoint.manifest import (
    MULTI_FILE_VERSION as MULTI_FILE_VERSION,  # re-exported
)
from raytrain_events.checkpoint.manifest import (
    UnsupportedCheckpointVersionError as UnsupportedCheckpointVersionError,  # re-exported
)
from raytrain_events.storage.fs import (
    LocalFileSystem,
    basename,
    join,
    list_dir,
    local_atomic_writer,
    read_bytes,
    resolve,
    storage_errors,
    to_url,
    write_bytes_create_only,
)
from raytrain_events.storage.objectstore import fetch_verified, open_upload, reader

_MANIFEST_SIZE_HINT = 2**20  # manifests are a few KB: fetched with one plain GET
_MMAP_MIN_SIZE = 2**20  # smaller local files are read into memory: a mapping costs more there
_MMAP_LOAD = os.name == "posix"  # Windows cannot delete a mapped file (prune would fail)


def new_checkpoint_url(root_url: str, *, timestamp: Mapping[str, int], name: str | None = None) -> str:
    """URL of a new checkpoint directory under ``root_url`` (nothing is written yet)."""
    return join(root_url, _check_file_name(name) if name else checkpoint_name(timestamp))


def rng_file_name(rank: int) -> str:
    """The per-rank file name each rank uploads its RNG state to."""
    return f"rng-rank{int(rank)}.pt"


def serialize(obj: Any) -> bytes:
    """``torch.save`` into bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_checkpoint_file(
    ckpt_url: str, file_name: str, obj: Any, *, storage_options: dict[str, Any] | None = None
) -> FileEntry:
    """Serialize ``obj`` and upload it atomically as ``<ckpt_url>/<file_name>``."""
    _check_file_name(file_name)
    fs, path = resolve(join(ckpt_url, file_name), storage_options)
    payload = _Payload(obj)
    _upload(fs, path, payload)
    return FileEntry(name=file_name, size=payload.size, sha256="", crc32=payload.crc32)


def commit_checkpoint(
    ckpt_url: str,
    *,
    entries: Iterable[FileEntry],
    timestamp: Mapping[str, int],
    world_size: int,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    verify_files: bool = True,
) -> CheckpointInfo:
    """Write the manifest (create-only), after checking every listed file is present.

    ``verify_files=False`` skips that check (one directory listing: a LIST request on object
    stores): for callers that uploaded every entry themselves and hold the ``FileEntry`` that
    ``write_checkpoint_file`` returned. Keep it on when entries come from other processes
    (other ranks): it catches a rank that wrote somewhere else, e.g. to a node-local path.
    """
    entries = tuple(sorted(entries, key=lambda e: e.name))
    fs, path = resolve(ckpt_url, storage_options)
    url = to_url(fs, path)
    if verify_files:
        sizes = {basename(e["name"]): e.get("size") for e in list_dir(fs, path)}
        for entry in entries:
            if sizes.get(entry.name) != entry.size:
                raise CheckpointError(
                    f"Cannot commit checkpoint {url!r}: file {entry.name!r} is missing or has "
                    f"size {sizes.get(entry.name)} instead of {entry.size}. Fix: make sure every "
                    "rank's write_checkpoint_file finished before commit_checkpoint."
                )
    info = CheckpointInfo(
        url=url,
        name=basename(path),
        format_version=MULTI_FILE_VERSION if any(e.crc32 for e in entries) else 1,  # 1: sha256s only
        library_version=_library_version(),
        created=time.time(),
        timestamp=_check_timestamp(timestamp),
        world_size=int(world_size),
        metadata=_check_metadata(metadata or {}),
        files=entries,
    )
    _create_manifest(fs, path, url, json.dumps(info.manifest(), indent=1, sort_keys=True).encode())
    return info


def write_packed_checkpoint(
    ckpt_url: str,
    *,
    files: Mapping[str, Any],
    timestamp: Mapping[str, int],
    world_size: int,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Serialize ``files`` and commit them as ONE packed ``manifest.json`` (one create-only PUT).

    For one process holding all of a checkpoint's files; see ``packed.py`` for the layout and
    ``packed.should_pack`` for when ``write_checkpoint`` chooses it.
    """
    for name in files:
        _check_file_name(name)
    fs, path = resolve(ckpt_url, storage_options)
    url = to_url(fs, path)
    info = CheckpointInfo(
        url=url,
        name=basename(path),
        format_version=packed.PACKED_VERSION,
        library_version=_library_version(),
        created=time.time(),
        timestamp=_check_timestamp(timestamp),
        world_size=int(world_size),
        metadata=_check_metadata(metadata or {}),
        files=(),  # set below, once serialized
        packed_size=0,  # set below, once the header's length is known
    )

    def with_files(entries: list[dict[str, Any]]) -> CheckpointInfo:
        entry = [FileEntry(e["name"], e["size"], "", e["offset"], e["crc32"]) for e in entries]
        return dataclasses.replace(info, files=tuple(entry))

    obj = packed.pack(files, lambda entries: packed.header_line(with_files(entries).manifest()))
    _create_manifest(fs, path, url, obj.data, crc32=obj.crc32)
    return dataclasses.replace(with_files(obj.entries), packed_size=len(obj.data))


def _create_manifest(fs: Any, path: str, url: str, data: bytes, crc32: int | None = None) -> None:
    try:
        write_bytes_create_only(fs, join(path, MANIFEST), data, crc32=crc32)
    except FileExistsError:
        raise CheckpointError(
            f"Checkpoint {url!r} is already committed; checkpoints are never "
            "overwritten. Fix: write to a new_checkpoint_url()."
        ) from None


def write_checkpoint(
    root_url: str,
    *,
    files: Mapping[str, Any],
    timestamp: Mapping[str, int],
    world_size: int,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    name: str | None = None,
    pack: bool | None = None,
) -> CheckpointInfo:
    """Write ``files`` (name -> nested tensors/containers/scalars) as a new committed checkpoint.

    ``pack``: True writes one packed object (``write_packed_checkpoint``), False one file each
    plus the manifest; None (default) packs when ``packed.should_pack`` says so (small, and not
    on a local filesystem).
    """
    _check_timestamp(timestamp)
    _check_metadata(metadata or {})
    url = new_checkpoint_url(root_url, timestamp=timestamp, name=name)
    if pack or (pack is None and packed.should_pack(resolve(url, storage_options)[0], files)):
        return write_packed_checkpoint(
            url,
            files=files,
            timestamp=timestamp,
            world_size=world_size,
            metadata=metadata,
            storage_options=storage_options,
        )
    entries = [write_checkpoint_file(url, n, obj, storage_options=storage_options) for n, obj in files.items()]
    return commit_checkpoint(
        url,
        entries=entries,
        timestamp=timestamp,
        world_size=world_size,
        metadata=metadata,
        storage_options=storage_options,
        verify_files=False,
    )  # every entry was uploaded just above


def read_manifest(ckpt_url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """The manifest of a committed checkpoint (CheckpointNotCommittedError if there is none).

    Reads the first ``packed.HEAD_BYTES`` of ``manifest.json`` (a packed one also holds the
    payloads), and the rest only if the manifest is longer."""
    fs, path = resolve(ckpt_url, storage_options)
    raw = _read_commit_object(fs, path, head=True)
    return CheckpointInfo.from_manifest(to_url(fs, path), raw)


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
    ckpt_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    map_location: Any = "cpu",
) -> LoadedCheckpoint:
    """Verify and load a committed checkpoint (all files, or only those named in ``files``).

    One GET of ``manifest.json`` (no HEAD: its size is bounded): a packed checkpoint is then
    all here; a multi-file one fetches its files next."""
    fs, path = resolve(ckpt_url, storage_options)
    raw = _read_commit_object(fs, path)
    info = CheckpointInfo.from_manifest(to_url(fs, path), raw)
    if info.packed:
        return LoadedCheckpoint(info=info, files=_load_packed(info, raw, _wanted(info, files), map_location))
    return read_checkpoint_files(info, storage_options=storage_options, files=files, map_location=map_location)


def read_checkpoint_files(
    info: CheckpointInfo,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    map_location: Any = "cpu",
) -> LoadedCheckpoint:
    """``read_checkpoint`` for a manifest already read (``read_manifest``, ``list_checkpoints``).

    If the checkpoint was deleted since, its missing files raise CheckpointCorruptError.
    """
    wanted = _wanted(info, files)
    fs, path = resolve(info.url, storage_options)
    if info.packed:  # one GET of the whole object, its size known: no HEAD
        try:
            raw = _read_commit_object(fs, path)
        except CheckpointNotCommittedError:
            raise CheckpointCorruptError(
                f"Checkpoint {info.url!r} was deleted since it was listed. Fix: load an older checkpoint."
            ) from None
        return LoadedCheckpoint(info=info, files=_load_packed(info, raw, wanted, map_location))
    loaded = {e.name: _load_verified(fs, join(path, e.name), info.url, e, map_location) for e in wanted}
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
    try:
        return torch.load(f, weights_only=True, map_location=map_location, **kw)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"Refused to load {entry.name!r} from checkpoint {url!r}: it asks torch's "
            f"weights-only unpickler for something outside its allowlist ({_reason(e)}). "
            "Nothing in the file was executed. Checkpoints written by raytrain_events never "
            "need this, so the file was written by other code or tampered with (its checksum "
            "matching proves nothing: the manifest can be rewritten too). Fix: only if you trust "
            "its origin, load it yourself with torch.load(..., weights_only=False) or allowlist "
            "the classes with torch.serialization.add_safe_globals([...])."
        ) from e


@dataclasses.dataclass
class _Payload:
    """One file to upload: ``obj`` goes in; ``_upload`` fills in ``size`` and ``crc32``."""

    obj: Any
    size: int = -1
    crc32: str = ""


def _upload(fs: Any, path: str, payload: _Payload) -> None:
    """Serialize and upload one payload atomically, filling in its size and CRC32 (a separate
    function so tests can inject failures here). Local: streamed, see the module docstring."""
    if isinstance(fs, LocalFileSystem):
        with local_atomic_writer(path, crc32=True) as f:
            try:
                with torch_zip_crc_off():  # our CRC32 covers these bytes
                    torch.save(payload.obj, f)
            except Exception:
                if f.error is not None:  # torch's zip writer replaced it with its own error
                    raise f.error from f.error.__cause__
                raise
        payload.size, payload.crc32 = f.size, f.hexdigest()
        return
    upload = open_upload(fs, path)  # CRC32s what it sends; big files go up in parts meanwhile
    try:
        try:
            with torch_zip_crc_off():  # our CRC32 covers these bytes
                torch.save(payload.obj, upload)
        except Exception:
            if upload.error is not None:  # torch's zip writer replaced it with its own error
                raise upload.error from upload.error.__cause__
            raise
        upload.finish()
    except BaseException:
        upload.abort()
        raise
    payload.size, payload.crc32 = upload.size, upload.hexdigest()


def _reason(err: Exception) -> str:
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
