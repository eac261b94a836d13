"""URL -> filesystem resolution and the few byte-level primitives the rest of storage uses.

Everything above this module (locks, run dirs, checkpoints) talks to storage only through
these functions, so the atomicity rules live in one place:

* ``write_bytes_atomic``: readers see the old object or the whole new one, never a prefix.
  Local files go through a temp file in the same directory + ``os.replace``; object stores
  get one ``pipe_file`` (a single PUT is atomic). We never use ``with fs.open(p, "wb")``
  for this: fsspec commits that object on exit even when the block raised.
* ``write_bytes_create_only``: the write fails with ``FileExistsError`` if the object
  already exists, decided by the backend itself (not check-then-write) where it can:
  local ``os.link`` (``O_EXCL`` fallback), memory ``dict.setdefault``, S3 ``If-None-Match: *``
  (s3fs ``pipe_file(..., mode="create")``, present in the installed 2026.9; needs a server
  that honours it: AWS S3, MinIO, moto).
  Other backends fall back to exists-check + write + read-back (a documented race window).
* Backend errors other than "not found"/"exists" become ``StorageError`` naming the URL.

Usage::

    fs, path = resolve("s3://bucket/runs", storage_options={"anon": False})
    write_bytes_atomic(fs, join(path, "x.json"), b"{}")
"""
from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from raytrain_events.storage.errors import StorageError

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
        raise StorageError(
            f"Storage failed while {what} at {url!r}: {type(e).__name__}: {e}. Fix: check that "
            "the URL is right, the endpoint is reachable and the credentials allow this.",
            url=url,
        ) from e


def read_bytes(fs: Any, path: str) -> bytes:
    """Read a whole object. FileNotFoundError if it does not exist."""
    with storage_errors("reading", to_url(fs, path)):
        return fs.cat_file(path)


def write_bytes_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a truncated object.

    Object stores: one ``pipe_file``; above ~100 MB s3fs switches to a multipart upload, which
    only becomes visible on CompleteMultipartUpload and is aborted on error.
    """
    with storage_errors("writing", to_url(fs, path)):
        if isinstance(fs, LocalFileSystem):
            _local_replace(path, data)
        else:
            fs.pipe_file(path, bytes(data))


def write_bytes_create_only(fs: Any, path: str, data: bytes) -> None:
    """Create ``path`` with ``data``; raise FileExistsError if it already exists.

    Atomic create-only on local (``os.link`` of a complete temp file), memory and S3
    (conditional PUT). On other backends: exists-check, write, then read back; two writers
    racing inside that window can both "win", the read-back catches only the loser whose
    bytes were overwritten before it looked.
    """
    with storage_errors("creating", to_url(fs, path)):
        if isinstance(fs, LocalFileSystem):
            _local_create_only(path, bytes(data))
        elif isinstance(fs, MemoryFileSystem):
            key = fs._strip_protocol(path)
            entry = MemoryFile(fs, key, bytes(data))
            if fs.store.setdefault(key, entry) is not entry:  # atomic under the GIL
                raise FileExistsError(path)
        elif _is_s3(fs) and _has_create_mode(fs):
            fs.pipe_file(path, bytes(data), mode="create")  # If-None-Match: *
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


def _is_s3(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols


def _has_create_mode(fs: Any) -> bool:
    """Whether this s3fs takes ``mode="create"``; older ones get the read-back fallback."""
    return "mode" in inspect.signature(getattr(fs, "_pipe_file", fs.pipe_file)).parameters


def _local_replace(path: str, data: bytes) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
