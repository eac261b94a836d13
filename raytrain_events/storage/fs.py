"""URL -> filesystem resolution and the few byte-level primitives the rest of storage uses.

Everything above this module (locks, run dirs, checkpoints) talks to storage only through
these functions, so the atomicity rules live in one place:

* ``write_bytes_atomic``: readers see the old object or the whole new one, never a prefix.
  Local files go through a temp file in the same directory + fsync + ``os.replace``; object
  stores get one ``pipe_file`` (a single PUT is atomic). We never use ``with fs.open(p, "wb")``
  for this: fsspec commits that object on exit even when the block raised.
  ``local_atomic_writer`` is the same for a local file written piece by piece (a streamed
  ``torch.save``), so the whole content never has to sit in memory first.
* ``write_bytes_create_only``: the write fails with ``FileExistsError`` if the object
  already exists, decided by the backend itself (not check-then-write) where it can:
  local ``os.link`` (``O_EXCL`` fallback), memory ``dict.setdefault``, S3 ``If-None-Match: *``
  (s3fs ``pipe_file(..., mode="create")``, present in the installed 2026.9; needs a server
  that honours it: AWS S3, MinIO, moto).
  Other backends fall back to exists-check + write + read-back (a documented race window).
* Backend errors other than "not found"/"exists" become ``StorageError`` naming the URL.
* A write to an async object store (s3fs, gcsfs, adlfs) has a deadline (`write_timeout_s`):
  the client's connect and read timeouts plus one second per MiB. botocore sends every PUT
  with ``Expect: 100-continue``, and aiohttp arms its read timeout only after the body is
  sent, so against a black-holed network the PUT waited for "100 Continue" forever (seen
  through tests/faultproxy.py: a save hung, and with it every later save and the run's end).
  Past the deadline the request is cancelled and the write fails with ``WriteTimeoutError`` (a
  ``StorageError`` and a ``TimeoutError``: retried by checkpoint saves) naming the URL, the size,
  the deadline and the settings that make it (``write_timeout_error``); fsspec's own
  ``FSTimeoutError`` says nothing at all. ``objectstore/``'s streamed uploads (single PUT and
  every request of a multipart upload) keep the same deadlines.

Usage::

    fs, path = resolve("s3://bucket/runs", storage_options={"anon": False})
    write_bytes_atomic(fs, join(path, "x.json"), b"{}")
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from raytrain_events.storage._compat import pipe_file_method, strip_protocol
from raytrain_events.storage.crc32 import Crc32, s3_checksum
from raytrain_events.storage.errors import StorageError, WriteTimeoutError

# protocol -> (pip extra, backend package) for the friendly ImportError.
_EXTRAS = {
    "s3": ("s3", "s3fs"),
    "s3a": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"),
    "gcs": ("gcs", "gcsfs"),
    "az": ("azure", "adlfs"),
    "abfs": ("azure", "adlfs"),
    "abfss": ("azure", "adlfs"),
    "adl": ("azure", "adlfs"),
}
# Errors with a meaning callers act on; never wrapped into StorageError.
_PASS_THROUGH = (FileNotFoundError, FileExistsError, StorageError)


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].split("::")[-1].lower() if "://" in url else "file"


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Return ``(fs, path)`` for a URL or plain local path (``file://`` works too).

    Raises ImportError naming the pip extra when the backend package is missing, and
    StorageError (naming the URL) for an unknown protocol or bad options.
    """
    try:
        return fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    except ImportError as e:
        extra, package = _EXTRAS.get(_protocol(str(url)), (None, None))
        if extra is None:
            raise
        raise ImportError(
            f"Storage URL {url!r} needs the optional package {package!r}, which is not "
            f"installed. Fix: pip install 'raytrain_events[{extra}]'"
        ) from e
    except Exception as e:
        raise StorageError(
            f"Cannot use storage URL {url!r}: {type(e).__name__}: {e}. Fix: check the URL's "
            "protocol and the storage_options passed with it.",
            url=str(url),
        ) from e


def refuse_file_folder(url: str, storage_options: dict[str, Any] | None = None, what: str = "save_folder") -> None:
    """Raise a StorageError if ``url``, meant as a folder (``what``), is an existing file.

    A save folder that is a file fails every save; a ``load_from`` naming a file inside a
    checkpoint (``.../state.pt``) is not a checkpoint. One ``isfile`` call.
    """
    fs, path = resolve(url, storage_options)
    try:
        is_file = fs.isfile(path)
    except Exception:  # unreachable storage: the first real read or write reports it with its own message
        return
    if is_file:
        parent = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else url
        fix = (
            f"point load_from at the checkpoint directory (the folder with manifest.json, e.g. {parent!r}) or "
            "at a folder of checkpoints"
            if what == "load_from"
            else "point save_folder (or storage_path / run_name) at a folder, or move that file away"
        )
        raise StorageError(f"{what}={url!r} is a file, not a folder. Fix: {fix}.", url=str(url))


def check_storage_url(url: str, what: str = "storage_path") -> None:
    """Refuse a URL whose protocol no fsspec backend knows (``s4://``), before any work starts.

    The one check of a storage URL's protocol: `RunSpec` (``storage_path``) and the command line
    (``storage=``) call it. A known protocol whose package is missing raises the ImportError naming
    the pip extra (`resolve`); reachability is checked by the first real read or write.
    """
    protocol = _protocol(str(url))
    if protocol == "file":
        return
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        extra, package = _EXTRAS.get(protocol, (None, None))
        if extra is not None:
            raise ImportError(
                f"{what}={url!r} needs the optional package {package!r}, which is not installed. "
                f"Fix: pip install 'raytrain_events[{extra}]'"
            ) from None
        raise
    except ValueError:
        known = ", ".join(f"{p}://" for p in ("s3", "gs", "az", "abfs", "file", "memory", "hdfs", "http"))
        raise StorageError(
            f"{what}={url!r}: {protocol!r} is not a storage protocol fsspec knows. Fix: use a local path or a URL "
            f"with a known protocol ({known}, ...).",
            url=str(url),
        ) from None


def join(url: str, *parts: str) -> str:
    """Join path parts onto a URL or local path with ``/`` (object stores have no ``\\``)."""
    out = str(url)
    if not out.endswith("://"):
        out = out.rstrip("/") or "/"
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = out + part if out.endswith("/") else f"{out}/{part}"
    return out


def to_url(fs: Any, path: str) -> str:
    """The full URL of ``path`` on ``fs`` (for messages and for handing to other processes)."""
    if isinstance(fs, LocalFileSystem):
        return path
    return fs.unstrip_protocol(path)


@contextlib.contextmanager
def storage_errors(what: str, url: str) -> Iterator[None]:
    """Turn backend exceptions into StorageError naming ``url`` (not-found/exists pass through)."""
    try:
        yield
    except _PASS_THROUGH:
        raise
    except Exception as e:
        raise storage_error(what, url, e) from e


def storage_error(what: str, url: str, e: Exception) -> StorageError:
    return StorageError(
        f"Storage failed while {what} at {url!r}: {type(e).__name__}: {e}. Fix: check that "
        "the URL is right, the endpoint is reachable and the credentials allow this.",
        url=url,
    )


def read_bytes(
    fs: Any, path: str, *, size_hint: int | None = None, end: int | None = None, single_get: bool = False
) -> bytes:
    """Read a whole object (or its first ``end`` bytes). FileNotFoundError if it does not exist.

    ``size_hint``: an upper bound of the object's size when the caller knows one (a manifest
    entry; a small file such as a manifest). It only changes how the object is fetched: s3fs
    otherwise sends a HEAD before the GET, to decide whether to split the download into
    concurrent ranged GETs, which it only does above ``fs.default_block_size`` (50 MiB).
    ``end``: read only ``[0, end)`` (one ranged GET; less if the object is shorter).
    ``single_get``: one plain GET whatever the size (no HEAD, no split into ranges).
    """
    with storage_errors("reading", to_url(fs, path)):
        return fs.cat_file(path, **_cat_kwargs(fs, 0 if single_get else size_hint, end))


def read_many(
    fs: Any, paths: Sequence[str], *, size_hint: int | None = None, end: int | None = None
) -> dict[str, bytes]:
    """Read several whole objects (concurrently on object stores): ``{path: bytes}`` for the
    ``paths`` as given; objects that are missing or fail to read are left out.
    ``size_hint`` and ``end`` as for ``read_bytes``, for every object."""
    if not paths:
        return {}
    with storage_errors("reading", to_url(fs, paths[0])):
        raw = fs.cat(list(paths), on_error="omit", **_cat_kwargs(fs, size_hint, end))
    got = {strip_protocol(fs, k): v for k, v in raw.items()}
    return {p: got[strip_protocol(fs, p)] for p in paths if strip_protocol(fs, p) in got}


def write_bytes_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a truncated object.

    Object stores: one ``pipe_file``; above ~100 MB s3fs switches to a multipart upload, which
    only becomes visible on CompleteMultipartUpload and is aborted on error.

    No ``ChecksumSHA256`` is passed to S3 even when the caller has the digest: over HTTPS
    botocore would then SHA256-sign the whole body for SigV4 instead of sending an unsigned
    CRC32 trailer, i.e. a slower pass than the CRC32 it saves (only over plain HTTP, where the
    body is signed anyway, is it a saving).
    """
    with storage_errors("writing", to_url(fs, path)):
        if isinstance(fs, LocalFileSystem):
            _local_replace(path, data)
        else:
            with _write_deadline(fs, path, len(data)):
                fs.pipe_file(path, bytes(data), **_deadline(fs, len(data)))


class AtomicLocalFile:
    """What ``local_atomic_writer`` yields: write-only, into a temp file beside the target.

    Counts the bytes (``size``) and, if asked, CRC32s them on the way (``hexdigest()``), so a
    streamed writer (``torch.save``) needs no second pass. An exception raised by ``write`` is
    also kept in ``error``: callers such as torch's zip writer replace it with their own.
    On Linux it asks the kernel to start writing each further 8 MiB to disk while the caller
    produces the rest (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, a hint: it neither waits nor
    guarantees anything), so the closing fsync has less left to wait for.
    """

    def __init__(self, f: Any, url: str, crc32: bool) -> None:
        self._f, self._url = f, url
        self._crc = Crc32() if crc32 else None
        self.size = 0
        self.error: BaseException | None = None
        self._kicked = 0

    def write(self, data: Any) -> int:
        try:
            self._f.write(data)
        except OSError as e:  # e.g. disk full
            self.error = storage_error("writing", self._url, e)
            raise self.error from e
        if self._crc is not None:
            self._crc.update(data)
        n = memoryview(data).nbytes
        self.size += n
        if self.size - self._kicked >= _WRITEBACK_BYTES:
            _start_writeback(self._f.fileno(), self._kicked, self.size - self._kicked)
            self._kicked = self.size
        return n

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        assert self._crc is not None, "local_atomic_writer(..., crc32=True) computes it"
        return self._crc.hexdigest()


@contextlib.contextmanager
def local_atomic_writer(path: str, *, crc32: bool = False) -> Iterator[AtomicLocalFile]:
    """Write a local file so that ``path`` holds the old content or the complete new one.

    Yields a file to ``write`` into (a temp file in the same directory). When the block ends
    normally: flush, fsync, ``os.replace`` onto ``path``. When it raises: the temp file is
    deleted and ``path`` is untouched. Errors of the file operations are StorageError.
    """
    with storage_errors("writing", path):
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield AtomicLocalFile(f, path, crc32)
            with storage_errors("writing", path):
                f.flush()
                os.fsync(f.fileno())
        with storage_errors("writing", path):
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_create_only(fs: Any, path: str, data: bytes, *, crc32: int | None = None) -> None:
    """Create ``path`` with ``data``; raise FileExistsError if it already exists.

    Atomic create-only on local (``os.link`` of a complete temp file), memory and S3
    (conditional PUT). On other backends: exists-check, write, then read back; two writers
    racing inside that window can both "win", the read-back catches only the loser whose
    bytes were overwritten before it looked. ``crc32``: ``zlib.crc32(data)`` if the caller
    has it; on S3 it goes with the PUT (``ChecksumCRC32``): S3 rejects the PUT if the bytes
    it received differ, and botocore does not compute its own CRC32 of the body again.
    """
    with storage_errors("creating", to_url(fs, path)):
        if isinstance(fs, LocalFileSystem):
            _local_create_only(path, bytes(data))
        elif isinstance(fs, MemoryFileSystem):
            key = strip_protocol(fs, path)
            entry = MemoryFile(fs, key, bytes(data))
            if fs.store.setdefault(key, entry) is not entry:  # atomic under the GIL
                raise FileExistsError(path)
        elif is_s3(fs) and _has_create_mode(fs):
            checksum = {} if crc32 is None else {"ChecksumCRC32": s3_checksum(crc32)}
            with _write_deadline(fs, path, len(data)):  # If-None-Match
                fs.pipe_file(path, bytes(data), mode="create", **checksum, **_deadline(fs, len(data)))
        else:
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, bytes(data))
            if fs.cat_file(path) != bytes(data):
                raise FileExistsError(path)


def delete(fs: Any, path: str, *, recursive: bool = False, missing_ok: bool = True) -> None:
    """Delete an object (or a whole prefix with ``recursive``)."""
    with storage_errors("deleting", to_url(fs, path)):
        try:
            fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            if not missing_ok:
                raise


def list_dir(fs: Any, path: str) -> list[dict[str, Any]]:
    """Fresh (uncached) directory listing with details; [] if the directory does not exist."""
    with storage_errors("listing", to_url(fs, path)):
        fs.invalidate_cache(path)
        try:
            return fs.ls(path, detail=True)
        except FileNotFoundError:
            return []


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def is_s3(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols


def _cat_kwargs(fs: Any, size_hint: int | None, end: int | None = None) -> dict[str, Any]:
    """s3fs: one plain GET (no HEAD first) when the object is known to be below the split size.
    (s3fs before the concurrent ``cat_file`` sends no HEAD and takes no ``max_concurrency``.)
    With ``end``: a range ``[0, end)``, one GET on every backend."""
    if end is not None:
        return {"start": 0, "end": int(end)}
    if (
        size_hint is not None
        and is_s3(fs)
        and size_hint <= getattr(fs, "default_block_size", 0)
        and "max_concurrency" in inspect.signature(getattr(fs, "_cat_file", fs.cat_file)).parameters
    ):
        return {"max_concurrency": 1}
    return {}


_MIN_WRITE_RATE = 1 << 20  # bytes/s: a write slower than this (beyond the timeouts) is stalled
_BOTOCORE_TIMEOUT_S = 60.0  # botocore's default connect and read timeouts


def write_timeout_s(fs: Any, nbytes: int) -> float:
    """The deadline of one write of ``nbytes`` (see the module docstring)."""
    config = getattr(fs, "config_kwargs", None) or {}
    connect = float(config.get("connect_timeout") or _BOTOCORE_TIMEOUT_S)
    read = float(config.get("read_timeout") or _BOTOCORE_TIMEOUT_S)
    return connect + read + nbytes / _MIN_WRITE_RATE


def write_timeout_error(fs: Any, path: str, nbytes: int, deadline_s: float, what: str = "") -> WriteTimeoutError:
    """The error of a write of ``nbytes`` to ``path`` that ran past ``deadline_s``: what timed out and what to set."""
    config = getattr(fs, "config_kwargs", None) or {}
    connect = float(config.get("connect_timeout") or _BOTOCORE_TIMEOUT_S)
    read = float(config.get("read_timeout") or _BOTOCORE_TIMEOUT_S)
    url = to_url(fs, path)
    return WriteTimeoutError(
        f"Writing {what or f'{nbytes} bytes'} to {url!r} did not finish within its {deadline_s:.1f} s deadline "
        f"(connect_timeout {connect:g} s + read_timeout {read:g} s + 1 s per MiB); the request was cancelled. "
        "Checkpoint saves retry it until CheckpointConfig.upload_deadline_s. Fix: if the store is reachable but "
        "slow, raise the deadline with storage_options={'config_kwargs': {'read_timeout': <s>, 'connect_timeout': "
        "<s>}}; otherwise check that the endpoint is reachable from this node.",
        url=url,
        nbytes=nbytes,
        deadline_s=deadline_s,
    )


@contextlib.contextmanager
def _write_deadline(fs: Any, path: str, nbytes: int) -> Iterator[None]:
    """fsspec's ``FSTimeoutError`` (empty message) of a write past its deadline -> ``WriteTimeoutError``."""
    try:
        yield
    except FSTimeoutError as e:
        raise write_timeout_error(fs, path, nbytes, write_timeout_s(fs, nbytes)) from e


def _deadline(fs: Any, nbytes: int) -> dict[str, Any]:
    """``timeout=`` for fsspec's sync wrapper of an async filesystem; nothing for others."""
    return {"timeout": write_timeout_s(fs, nbytes)} if getattr(fs, "async_impl", False) else {}


def _has_create_mode(fs: Any) -> bool:
    """Whether this s3fs takes ``mode="create"``; older ones get the read-back fallback."""
    return _takes_mode(type(fs))


@functools.cache
def _takes_mode(cls: type) -> bool:  # once per class: inspect.signature costs ~30 us a call
    return "mode" in inspect.signature(pipe_file_method(cls)).parameters


def _local_replace(path: str, data: bytes) -> None:
    with local_atomic_writer(path) as f:
        f.write(data)


_WRITEBACK_BYTES = 8 * 2**20
_sync_file_range: Any = None  # None: not looked up yet; False: unavailable


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Linux: start (not wait for) writing a file range to disk; elsewhere nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_file_range = fn
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; errors ignored: a hint


def _local_create_only(path: str, data: bytes) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # create-only AND the content is complete the moment it appears
    except FileExistsError:
        raise
    except OSError:  # filesystem without hard links: O_EXCL create, then write
        with open(path, "xb") as f:
            f.write(data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
