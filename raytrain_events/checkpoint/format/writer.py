"""Writing one checkpoint: payload files uploaded atomically, then the manifest that commits them.

The layout, the commit rule and the I/O paths are described in ``format/__init__.py``; reading
is ``reader.py``. Several ranks: rank 0 names the directory (``new_checkpoint_url``), every rank
uploads its files with ``write_checkpoint_file`` and rank 0 commits all entries
(``commit_checkpoint``); ``write_checkpoint`` does it all for one process, packed
(``write_packed_checkpoint``, one PUT) when small and on an object store.

A save is one frozen `CheckpointSave` (where, as a `Location` resolved once, and what its manifest
records besides the files), built where the save is decided (``write_checkpoint``, the
`Checkpointer`) and passed down whole to ``write_and_commit``. The public functions take a URL or
a `Location`; each resolves a URL once and passes the `Location` on.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from raytrain_events.checkpoint.format import packed
from raytrain_events.checkpoint.format.checksums import torch_zip_crc_off
from raytrain_events.checkpoint.format.local_copy import LocalCopies, LocalCopyFile, TeeStream
from raytrain_events.checkpoint.format.manifest import (
    MANIFEST,
    MULTI_FILE_VERSION,
    CheckpointError,
    CheckpointInfo,
    FileEntry,
    _check_file_name,
    _check_metadata,
    _check_timestamp,
    _library_version,
    checkpoint_name,
)
from raytrain_events.storage.fs import (
    LocalFileSystem,
    basename,
    join,
    list_dir,
    local_atomic_writer,
    write_bytes_create_only,
)
from raytrain_events.storage.location import Location
from raytrain_events.storage.objectstore import open_upload


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


@dataclasses.dataclass(frozen=True)
class CheckpointSave:
    """One save, decided once: where it goes and what its manifest records besides the files.

    Built where the save is decided (``write_checkpoint``, `Checkpointer.save`) and passed down
    whole (`Committer.commit`, ``write_and_commit``): the files and the entries other ranks wrote
    are produced on the way and travel beside it. ``timestamp`` and ``metadata`` are read-only
    copies of what was given. ``local``: where this process also keeps a node-local copy of the files it
    writes (``CheckpointConfig(local_dir=...)``; None: no local tier)."""

    location: Location
    timestamp: Mapping[str, int]
    world_size: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    local: LocalCopies | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timestamp", MappingProxyType(dict(_check_timestamp(self.timestamp))))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        object.__setattr__(self, "world_size", int(self.world_size))

    @property
    def url(self) -> str:
        """The checkpoint directory's URL."""
        return self.location.url

    def with_metadata(self, **extra: Any) -> CheckpointSave:
        """This save with ``extra`` added to its metadata (e.g. a sharded save's layout)."""
        return dataclasses.replace(self, metadata={**self.metadata, **extra})


def write_checkpoint_file(
    ckpt: str | Location,
    file_name: str,
    obj: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    local: LocalCopies | None = None,
) -> FileEntry:
    """Serialize ``obj`` and upload it atomically as ``<ckpt>/<file_name>`` (``ckpt``: a URL or a
    `Location`); with ``local``, the same bytes also go into the node-local copy (``local_copy.py``)."""
    _check_file_name(file_name)
    target = Location.of(ckpt, storage_options).child(file_name)
    copy = local.file(file_name) if local is not None else None
    payload = _Payload(obj, copy)
    ok = False
    try:
        _upload(target.fs, target.path, payload)
        ok = True
    finally:
        if copy is not None:
            copy.close(ok)
    return FileEntry(name=file_name, size=payload.size, sha256="", crc32=payload.crc32)


def commit_checkpoint(
    ckpt: str | Location,
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
    where = Location.of(ckpt, storage_options)
    fs, path, url = where.fs, where.path, where.url
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
        metadata=_check_metadata(dict(metadata or {})),
        files=entries,
    )
    _create_manifest(where, json.dumps(info.manifest(), indent=1, sort_keys=True).encode())
    return info


def write_packed_checkpoint(
    ckpt: str | Location,
    *,
    files: Mapping[str, Any],
    timestamp: Mapping[str, int],
    world_size: int,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    local: LocalCopies | None = None,
) -> CheckpointInfo:
    """Serialize ``files`` and commit them as ONE packed ``manifest.json`` (one create-only PUT).

    For one process holding all of a checkpoint's files; see ``packed.py`` for the layout and
    ``packed.should_pack`` for when ``write_checkpoint`` chooses it. ``local``: each file's bytes (a
    slice of the packed object: no second serialization) also go into the node-local copy.
    """
    for name in files:
        _check_file_name(name)
    where = Location.of(ckpt, storage_options)
    info = CheckpointInfo(
        url=where.url,
        name=where.name,
        format_version=packed.PACKED_VERSION,
        library_version=_library_version(),
        created=time.time(),
        timestamp=_check_timestamp(timestamp),
        world_size=int(world_size),
        metadata=_check_metadata(dict(metadata or {})),
        files=(),  # set below, once serialized
        packed_size=0,  # set below, once the header's length is known
    )

    def with_files(entries: list[dict[str, Any]]) -> CheckpointInfo:
        entry = [FileEntry(e["name"], e["size"], "", e["offset"], e["crc32"]) for e in entries]
        return dataclasses.replace(info, files=tuple(entry))

    obj = packed.pack(files, lambda entries: packed.header_line(with_files(entries).manifest()))
    _create_manifest(where, obj.data, crc32=obj.crc32)
    if local is not None:
        view = memoryview(obj.data)
        start = len(obj.data) - sum(e["size"] for e in obj.entries)
        for e in obj.entries:
            copy = local.file(e["name"])
            copy.write(view[start + e["offset"] : start + e["offset"] + e["size"]])
            copy.close(True)
    return dataclasses.replace(with_files(obj.entries), packed_size=len(obj.data))


def _create_manifest(where: Location, data: bytes, crc32: int | None = None) -> None:
    try:
        write_bytes_create_only(where.fs, join(where.path, MANIFEST), data, crc32=crc32)
    except FileExistsError:
        raise CheckpointError(
            f"Checkpoint {where.url!r} is already committed; checkpoints are never "
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
    save = CheckpointSave(Location.of(url, storage_options), timestamp, world_size, metadata or {})
    return write_and_commit(save, files, pack=pack)


def write_and_commit(
    save: CheckpointSave,
    files: Mapping[str, Any],
    *,
    others: Sequence[FileEntry] = (),
    pack: bool | None = None,
) -> CheckpointInfo:
    """Upload ``files`` into ``save``'s location and commit them with ``others`` (files other
    processes wrote: their presence is checked at commit). One packed object when nobody else wrote
    files and ``pack`` (or, with None, ``packed.should_pack``) says so; else one file each plus the
    manifest."""
    where, timestamp, world_size, metadata = save.location, save.timestamp, save.world_size, save.metadata
    if not others and (pack or (pack is None and packed.should_pack(where.fs, files))):
        return write_packed_checkpoint(
            where, files=files, timestamp=timestamp, world_size=world_size, metadata=metadata, local=save.local
        )
    own = [write_checkpoint_file(where, n, obj, local=save.local) for n, obj in files.items()]
    return commit_checkpoint(
        where,
        entries=list(others) + own,
        timestamp=timestamp,
        world_size=world_size,
        metadata=metadata,
        verify_files=bool(others),
    )


@dataclasses.dataclass
class _Payload:
    """One file to upload: ``obj`` goes in (and its bytes also to ``copy``, the node-local tier's, when
    given); ``_upload`` fills in ``size`` and ``crc32``."""

    obj: Any
    copy: LocalCopyFile | None = None
    size: int = -1
    crc32: str = ""


def _torch_save(obj: Any, stream: Any) -> None:
    """``torch.save`` into one of our CRC32-ing streams (``stream.error``: what the stream itself failed with)."""
    try:
        with torch_zip_crc_off():  # our CRC32 covers these bytes
            torch.save(obj, stream)
    except Exception:
        if stream.error is not None:  # torch's zip writer replaced it with its own error
            raise stream.error from stream.error.__cause__
        raise


def _upload(fs: Any, path: str, payload: _Payload) -> None:
    """Serialize and upload one payload atomically, filling in its size and CRC32 (a separate
    function so tests can inject failures here). Local: streamed, see the module docstring.
    ``payload.copy``: the node-local copy the same bytes also go to, in the same pass."""
    copy = payload.copy
    if isinstance(fs, LocalFileSystem):
        with local_atomic_writer(path, crc32=True) as f:
            _torch_save(payload.obj, f if copy is None else TeeStream(f, copy))
        payload.size, payload.crc32 = f.size, f.hexdigest()
        return
    upload = open_upload(fs, path)  # CRC32s what it sends; big files go up in parts meanwhile
    try:
        _torch_save(payload.obj, upload if copy is None else TeeStream(upload, copy))
        upload.finish()
    except BaseException:
        upload.abort()
        raise
    payload.size, payload.crc32 = upload.size, upload.hexdigest()
