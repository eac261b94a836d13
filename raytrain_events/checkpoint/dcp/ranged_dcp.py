"""Read only the bytes a rank needs of each saved DCP tensor item (ranged reads on a reshard).

DCP's ``FileSystemReader.read_data`` reads every saved item that overlaps a rank's new shard
whole (the item's ``torch.save`` bytes, ``[offset, offset + length)`` of a ``.distcp`` file),
``torch.load``s it and trims it. On an N -> M reshard a saved dim-0 shard overlaps two or more
new ones, so the job reads 1.5-9x the checkpoint (issue 28). Here no format change is needed:
each item is a ``torch.save`` zip whose records are stored uncompressed, so the tensor's raw
bytes lie contiguous in the file at a place the zip's central directory tells.

For each tensor item a rank needs only part of, `plan_reads` fetches the head and the tail of
the item (`PROBE` bytes each: the local headers, ``data.pkl`` and the central directory of a
plain one-tensor ``torch.save``), decodes ``data.pkl`` with `_LayoutUnpickler` (which resolves
only the tensor-rebuild function and storage types, to markers: nothing in the file runs), and,
when the requested box is one contiguous run of a contiguous little-endian tensor, reads that
run alone. Anything else (small items, a box that is not contiguous, a transform such as
compression, an unexpected layout) is read whole as DCP does, so old and foreign checkpoints
load as before.

Cost per rank and tensor item: 3 ranged reads (head, tail, data) of ``2 * PROBE`` bytes plus
the overlap, instead of 1 read of the whole item. Requests go through fsspec's ``cat_ranges``
(concurrent on s3fs), one batch for the probes and one for the data.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["PROBE", "TensorLayout", "contiguous_run", "parse_layout", "plan_reads"]

PROBE = 1024  # bytes read at each end of an item to find its tensor's bytes
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)


@dataclass(frozen=True)
class TensorLayout:
    """Where a saved item's tensor data lies, relative to the item's first byte."""

    data_start: int
    storage_offset: int  # in elements
    size: Tuple[int, ...]
    dtype: torch.dtype


class _Rebuilt:
    def __init__(self, storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> None:
        self.storage, self.storage_offset, self.size, self.stride = storage, storage_offset, size, stride


class _LayoutUnpickler(pickle.Unpickler):
    """Decodes a one-tensor ``data.pkl`` into a `_Rebuilt` record; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return pid  # ("storage", type name, key, location, numel)


class _Window(io.RawIOBase):
    """The bytes of one item as a seekable file, served from the probed head and tail;
    a read outside them raises `_Miss` (the item is then read whole)."""

    def __init__(self, length: int, head: bytes, tail: bytes) -> None:
        super().__init__()
        self.length, self.head, self.tail, self.pos = length, head, tail, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        start, self.pos = self.pos, end
        if end <= len(self.head):
            return self.head[start:end]
        tail_start = self.length - len(self.tail)
        if start >= tail_start:
            return self.tail[start - tail_start : end - tail_start]
        raise _Miss


class _Miss(Exception):
    """A byte the probes did not fetch was needed."""


def parse_layout(length: int, head: bytes, tail: bytes) -> Optional[TensorLayout]:
    """The layout of a one-tensor ``torch.save`` item from its first and last bytes, or None
    when it is not one of those (or needs bytes outside the probes)."""
    try:
        window = _Window(length, head, tail)
        with zipfile.ZipFile(window) as archive:
            infos = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            pkl = infos.get("data.pkl")
            if pkl is None or any(i.compress_type != zipfile.ZIP_STORED for i in infos.values()):
                return None
            record = _LayoutUnpickler(io.BytesIO(_record(window, pkl))).load()
            if "byteorder" in infos and _record(window, infos["byteorder"]) != b"little":
                return None
            if not isinstance(record, _Rebuilt):
                return None
            _, type_name, key, _, numel = record.storage
            data = infos.get(f"data/{key}")
            with warnings.catch_warnings():  # the legacy storage class names its dtype (TypedStorage warns)
                warnings.simplefilter("ignore")
                dtype = getattr(torch, type_name).dtype
            size, stride = tuple(int(s) for s in record.size), tuple(int(s) for s in record.stride)
            if data is None or stride != _contiguous_strides(size) or data.file_size != numel * _itemsize(dtype):
                return None
            return TensorLayout(_data_start(window, data), int(record.storage_offset), size, dtype)
    except (_Miss, zipfile.BadZipFile, pickle.UnpicklingError, struct.error, EOFError, LookupError):
        return None  # not a plain one-tensor item, or it needs bytes outside the probes: read it whole
    except (ValueError, TypeError, AttributeError):
        return None


def _record(window: _Window, info: zipfile.ZipInfo) -> bytes:
    start = _data_start(window, info)
    window.seek(start)
    return window.read(info.file_size)


def _data_start(window: _Window, info: zipfile.ZipInfo) -> int:
    window.seek(info.header_offset)
    header = _LOCAL_HEADER.unpack(window.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        raise zipfile.BadZipFile("no local header")
    return info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_strides(size: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(int(s), 1)
    return tuple(reversed(strides))


def contiguous_run(size: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(first element, element count) of the box ``offsets + lengths`` of a contiguous tensor of
    ``size`` if the box is one contiguous run of it, else None."""
    dims = len(size)
    first = next((d for d in range(dims) if lengths[d] != 1), dims)
    if any(lengths[d] != size[d] for d in range(first + 1, dims)):
        return None
    strides = _contiguous_strides(size)
    count = 1
    for n in lengths:
        count *= int(n)
    return sum(int(o) * s for o, s in zip(offsets, strides)), count


@dataclass
class RangedRead:
    """A ReadItem served by a ranged read: ``nbytes`` bytes at ``start`` of ``path``."""

    request: Any
    path: str
    start: int
    nbytes: int
    dtype: torch.dtype
    lengths: Tuple[int, ...]


def plan_reads(fs: Any, requests: List[Tuple[Any, str, Any, Any]]) -> Tuple[List[RangedRead], List[Any]]:
    """Split tensor ``requests`` ((ReadItem, path, storage info, chunk metadata)) into ranged
    reads and the requests to read whole. Fetches the probes of the candidates (one batch)."""
    candidates: Dict[Tuple[str, int], List[Tuple[Any, Any, Any]]] = {}
    whole: List[Any] = []
    for req, path, info, chunk in requests:
        wanted = _wanted_bytes(req, chunk)
        if info.transform_descriptors or wanted is None or wanted + 2 * PROBE >= info.length:
            whole.append(req)
        else:
            candidates.setdefault((path, info.offset), []).append((req, info, chunk))
    if not candidates:
        return [], whole
    keys = list(candidates)
    paths, starts, ends = [], [], []
    for path, offset in keys:
        length = candidates[(path, offset)][0][1].length
        paths += [path, path]
        starts += [offset, offset + length - PROBE]
        ends += [offset + PROBE, offset + length]
    blobs = fs.cat_ranges(paths, starts, ends)
    ranged: List[RangedRead] = []
    for i, key in enumerate(keys):
        group = candidates[key]
        head, tail = blobs[2 * i], blobs[2 * i + 1]
        layout = None
        if isinstance(head, bytes) and isinstance(tail, bytes):
            layout = parse_layout(group[0][1].length, head, tail)
        for req, info, chunk in group:
            read = _ranged(req, key[0], info, chunk, layout)
            if read is None:
                whole.append(req)
            else:
                ranged.append(read)
    return ranged, whole


def _wanted_bytes(req: Any, chunk: Any) -> Optional[int]:
    if chunk is None:
        return None
    count = 1
    for n in req.lengths:
        count *= int(n)
    return count * _itemsize(chunk.dtype)


def _ranged(req: Any, path: str, info: Any, chunk: Any, layout: Optional[TensorLayout]) -> Optional[RangedRead]:
    if layout is None or layout.dtype != chunk.dtype or layout.size != tuple(chunk.sizes):
        return None
    run = contiguous_run(layout.size, req.storage_offsets, req.lengths)
    if run is None:
        return None
    first, count = run
    itemsize = _itemsize(layout.dtype)
    start = info.offset + layout.data_start + (layout.storage_offset + first) * itemsize
    if start + count * itemsize > info.offset + info.length:
        return None
    return RangedRead(req, path, start, count * itemsize, layout.dtype, tuple(int(n) for n in req.lengths))


def fetch(fs: Any, reads: List[RangedRead]) -> List[torch.Tensor]:
    """The tensors of ``reads``, fetched in one ``cat_ranges`` batch."""
    if not reads:
        return []
    blobs = fs.cat_ranges(
        [r.path for r in reads], [r.start for r in reads], [r.start + r.nbytes for r in reads], on_error="raise"
    )
    tensors = []
    for read, blob in zip(reads, blobs):
        if len(blob) != read.nbytes:
            raise OSError(f"ranged read of {read.path} returned {len(blob)} bytes, expected {read.nbytes}")
        tensors.append(torch.frombuffer(bytearray(blob), dtype=read.dtype).reshape(read.lengths))
    return tensors
