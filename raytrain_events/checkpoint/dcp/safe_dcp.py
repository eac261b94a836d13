"""torch.distributed.checkpoint (DCP) made safe to load, and writing that hashes as it goes.

DCP as shipped runs code from a crafted checkpoint in two places: ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` turns
non-tensor items back with ``torch.load(weights_only=False)``. Here:

* `SafeDCPReader` unpickles ``.metadata`` with `MetadataUnpickler`, which resolves only DCP's
  metadata classes (and torch.Size, dtypes, layouts, paths): any other global, such as
  ``os.system``, raises `UnsafeCheckpointError` before anything is called.
* `SafeLoadPlanner` / `SafeFullLoadPlanner` load byte items with ``torch.load(weights_only=True)``.
  (Tensor items are read by DCP itself with ``weights_only=True`` already.)
* `HashingDCPWriter` is DCP's fsspec writer whose output streams count and CRC32 every byte
  written, so each rank can hand its files' ``FileEntry`` (name, size, crc32) to the
  manifest without reading them back (sha256 before format_version 4; still read).

Any fsspec URL works (``resolve`` of our storage layer picks the filesystem and its options).

The node-local tier (``format/local_copy.py``): `HashingDCPWriter` given ``local`` writes each file it
streams to storage into the local copy too, in the same pass; `SafeDCPReader` given ``local`` and the
manifest's entries reads each file from the local copy where it matches its entry (size and CRC32), and from
storage otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pathlib
import pickle
import threading
from contextlib import closing, contextmanager
from typing import Any, Dict, Iterator, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from raytrain_events._torch_compat import EmptyStateDictLoadPlanner as _EmptyStateDictLoadPlanner
from raytrain_events._torch_compat import FsspecFileSystem as FileSystem
from raytrain_events._torch_compat import FsspecReader, FsspecWriter, get_layout, set_element
from raytrain_events._torch_compat import StorageInfo as _StorageInfo
from raytrain_events.checkpoint.dcp import ranged_dcp
from raytrain_events.checkpoint.dcp.item_stream import ItemStream
from raytrain_events.checkpoint.format.checksums import checksum
from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.checkpoint.format.manifest import CheckpointCorruptError, FileEntry, UnsafeCheckpointError
from raytrain_events.checkpoint.format.reader import LOCAL_FS as _LOCAL_FS
from raytrain_events.checkpoint.format.reader import refusal_reason
from raytrain_events.checkpoint.format.safety import require_safe_torch
from raytrain_events.storage.crc32 import Crc32

__all__ = [
    "HashingDCPWriter",
    "MetadataUnpickler",
    "SafeDCPReader",
    "SafeFullLoadPlanner",
    "SafeLoadPlanner",
    "load_metadata_safely",
]

_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): get_layout,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # read as a pure path: nothing touches the disk
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: an allowlist of the classes it is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and name in _METADATA_CLASSES:
            return getattr(dcp_metadata, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not one of DCP's metadata classes")


def load_metadata_safely(stream: Any, where: str) -> Metadata:
    """Read a DCP ``.metadata`` pickle with `MetadataUnpickler`; `UnsafeCheckpointError` otherwise."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except (pickle.UnpicklingError, AttributeError, TypeError, KeyError, EOFError, ValueError) as e:
        raise UnsafeCheckpointError(
            f"Refused to load the DCP metadata {where!r}: {type(e).__name__}: {e}. It is not plain DCP "
            "metadata (only DCP's metadata classes are allowed; nothing in the file was executed), so it was "
            "written by other code or tampered with. Fix: load a checkpoint written by raytrain_events, "
            "or, only if you trust its origin, torch.distributed.checkpoint's own reader."
        ) from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"The DCP metadata {where!r} holds a {type(metadata).__name__}, not a Metadata: refused. "
            "Fix: load a checkpoint written by raytrain_events."
        )
    return metadata


class SafeDCPReader(FsspecReader):
    """DCP's fsspec reader with `MetadataUnpickler` in place of ``pickle.load``, reading only the
    bytes of each saved tensor that this rank needs (``ranged_dcp.py``).

    ``metadata``: the checkpoint's `Metadata` read and verified already (by one rank, then shared):
    ``read_metadata`` returns it instead of reading ``.metadata`` again. ``expected``: the manifest's
    entry for ``.metadata``; its size and checksum are checked after the safe unpickling.
    """

    def __init__(
        self,
        path: Any,
        metadata: Optional[Metadata] = None,
        expected: Optional[FileEntry] = None,
        local: Optional[LocalCopies] = None,
        entries: Any = (),
        **storage_options: Any,
    ) -> None:
        """``local``: the node-local copy to read from where a file matches its entry in ``entries`` (the
        committed manifest's files)."""
        super().__init__(path, **storage_options)
        self.shared_metadata, self.expected = metadata, expected
        self.metadata: Optional[Metadata] = None
        self.local, self._entries = local, {e.name: e for e in entries}
        self._sources: Dict[str, Any] = {}  # storage path -> (fs, path) it is read from

    def source(self, path: Any) -> Any:
        """(filesystem, path) to read the checkpoint file at storage ``path`` from: its local copy if it
        matches the manifest, else storage. Decided once per file."""
        path = os.fspath(path)
        if path not in self._sources:
            name = os.path.basename(path)
            entry = self._entries.get(name)
            local = self.local.verified(entry) if self.local is not None and entry is not None else None
            self._sources[path] = (_LOCAL_FS, local) if local is not None else (self.fs.fs, path)
        return self._sources[path]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        require_safe_torch("a sharded checkpoint")  # DCP reads its tensors with the weights-only unpickler
        if self.shared_metadata is not None:
            metadata = copy.copy(self.shared_metadata)
            metadata.storage_meta = copy.copy(metadata.storage_meta) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
        path = self._get_metadata_path(kwargs.get("rank"))
        fs, where = self.source(path)
        with fs.open(where, "rb") as stream:
            raw = stream.read()
        metadata = load_metadata_safely(io.BytesIO(raw), os.fspath(path))
        if self.expected is not None:
            _verify(raw, self.expected, os.fspath(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Tensor items this rank needs only part of are read by ranged reads of that part; the
        rest (byte items, whole or small items, anything unusual) by DCP's own reader."""
        requests, rest = [], []
        for req in plan.items:
            chunk = self._chunk(req) if req.type != LoadItemType.BYTE_IO else None
            if chunk is None:
                rest.append(req)
                continue
            info = self.storage_data[req.storage_index]
            requests.append((req, os.fspath(self.fs.concat_path(self.path, info.relative_path)), info, chunk))
        by_source: Dict[int, Any] = {}  # the local tier's files and storage's, each read through its own fs
        for req, path, info, chunk in requests:
            fs, where = self.source(path)
            by_source.setdefault(id(fs), (fs, []))[1].append((req, where, info, chunk))
        for fs, group in by_source.values():
            ranged, whole = ranged_dcp.plan_reads(fs, group)
            for read, tensor in zip(ranged, ranged_dcp.fetch(fs, ranged)):
                target = planner.resolve_tensor(read.request).detach()
                if target.size() != tensor.size():
                    raise AssertionError(
                        f"req {read.request.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(read.request, target)
            rest += whole
        if not rest:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self._read_items_exactly(dataclasses.replace(plan, items=rest), planner)

    def _read_items_exactly(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's own read of ``plan``, through streams that fetch each planned item once and nothing
        past it (`ItemStream`), instead of fsspec's read-ahead streams."""
        spans: Dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            path = os.fspath(self.fs.concat_path(self.path, info.relative_path))
            spans.setdefault(path, []).append((info.offset, info.length))

        def exact_stream(path: Any, mode: str) -> Any:
            fs, where = self.source(path)
            return closing(ItemStream(fs, where, spans[os.fspath(path)]))

        self.fs.create_stream = exact_stream  # type: ignore[method-assign]  # this call's reads only
        try:
            return super().read_data(plan, planner)
        finally:
            del self.fs.create_stream

    def _chunk(self, req: Any) -> Optional[_Chunk]:
        item = self.metadata.state_dict_metadata.get(req.storage_index.fqn) if self.metadata else None
        if not isinstance(item, TensorStorageMetadata):
            return None
        offsets = tuple(req.storage_index.offset or ())
        for chunk in item.chunks:
            if tuple(chunk.offsets) == offsets:
                return _Chunk(item.properties.dtype, tuple(int(s) for s in chunk.sizes))
        return None


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """The dtype and size of one saved chunk (what `ranged_dcp` checks the file against)."""

    dtype: torch.dtype
    sizes: tuple


def _verify(raw: bytes, entry: FileEntry, where: str) -> None:
    algorithm, expected = entry.checksum
    digest = checksum(algorithm, raw) if expected else ""
    if len(raw) != entry.size or digest != expected:
        raise CheckpointCorruptError(
            f"The DCP metadata {where!r} does not match the checkpoint's manifest (expected {entry.size} bytes "
            f"with {algorithm} {expected}, got {len(raw)} bytes with {digest}). Fix: load an older checkpoint."
        )


def _load_bytes_safely(value: io.BytesIO, fqn: str) -> Any:
    require_safe_torch(f"the DCP item {fqn!r}")
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"Refused to load the DCP item {fqn!r}: torch's weights-only unpickler found something outside "
            f"its allowlist ({refusal_reason(e)}). Nothing in it was executed. Checkpoints written by raytrain_events "
            "hold only tensors and plain values, so it was written by other code or tampered with. Fix: load a "
            "checkpoint you trust."
        ) from e


class _SafeBytes:
    """``load_bytes`` of DefaultLoadPlanner, with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = _load_bytes_safely(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """Load into a given state dict (resharding as DCP does); byte items loaded weights-only."""


class SafeFullLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Load everything a checkpoint holds as full tensors (no target needed): for export."""


class _HashingStream(io.RawIOBase):
    """Write-through stream that counts and CRC32s the bytes (DCP asks it for ``tell``)."""

    def __init__(self, raw: Any, copy: Any = None) -> None:
        super().__init__()
        self._raw, self._crc, self.size, self._copy = raw, Crc32(), 0, copy

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view)
        if self._copy is not None:
            self._copy.write(view)
        self._crc.update(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:  # the raw stream is closed by its own context manager
        if not self.closed:
            self.flush()
        super().close()

    def hexdigest(self) -> str:
        return self._crc.hexdigest()


class _HashingFileSystem(FileSystem):
    """fsspec file system of DCP whose write streams record a `FileEntry` per file written."""

    def __init__(self, local: Optional[LocalCopies] = None) -> None:
        super().__init__()
        self.entries: Dict[str, FileEntry] = {}
        self._lock = threading.Lock()
        self.local = local  # the node-local copy each written file also goes to

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            name = os.path.basename(os.fspath(path))
            copy = self.local.file(name) if self.local is not None else None
            stream = _HashingStream(raw, copy)
            ok = False
            try:
                yield stream
                ok = True
            finally:
                if copy is not None:
                    copy.close(ok)
            with self._lock:
                self.entries[name] = FileEntry(name=name, size=stream.size, sha256="", crc32=stream.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        if self.local is not None and os.path.exists(self.local.path(old)):
            os.replace(self.local.path(old), self.local.path(new))
        with self._lock:
            if old in self.entries:
                entry = self.entries.pop(old)
                self.entries[new] = dataclasses.replace(entry, name=new)


class HashingDCPWriter(FsspecWriter):
    """DCP's fsspec writer; ``entries`` lists the files this rank wrote with size and CRC32."""

    def __init__(
        self,
        path: str,
        storage_options: Optional[Dict[str, Any]] = None,
        local_copy: Optional[LocalCopies] = None,
        **kwargs: Any,
    ) -> None:
        local = "://" not in path or path.startswith("file://")
        # fsync local files; object stores commit on close (fsync would fall back to os.sync()).
        super().__init__(path, sync_files=local, overwrite=False, **kwargs, **(storage_options or {}))
        fs = _HashingFileSystem(local_copy)
        fs.fs = self.fs.fs
        self.fs = fs

    @property
    def entries(self) -> list:
        """`FileEntry` of each file written by this rank (its shards; ``.metadata`` on the coordinator)."""
        return sorted(self.fs.entries.values(), key=lambda e: e.name)
