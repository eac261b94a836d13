"""One checkpoint's node-local copy: its files written beside the upload, and read only where they match.

The local tier (``CheckpointConfig(local_dir=...)``, ``folder/local_tier.py``) gives each checkpoint a
directory on the node's disk. Saving: the bytes each process serializes for storage go, in the same
pass, into that directory too (`LocalCopyFile` is a second destination of the upload's stream, or of a
packed object's bytes): no second ``torch.save``, no read back. A local write that fails (disk full) is
dropped with a warning; the upload goes on: storage is the truth.

Loading: a file is read from the local copy only if its size and checksum (CRC32) equal the committed
manifest's entry for it (``verified``, or the reader's own check of a mapped file); otherwise (missing,
truncated, corrupt, another node's file) it is read from storage. `LocalCopies` records which files
each tier served, so the loader can say so in one log line.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import Any

from raytrain_events.checkpoint.format.checksums import checksum
from raytrain_events.checkpoint.format.manifest import FileEntry
from raytrain_events.storage.fs import local_atomic_writer

__all__ = ["LocalCopies", "LocalCopyFile", "TeeStream"]

_log = logging.getLogger(__name__)


class LocalCopies:
    """The local copy directory of one checkpoint (``directory``), and what each tier served from it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.local: list[str] = []  # files read from the local copy
        self.storage: dict[str, str] = {}  # files read from storage, and why

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def file(self, name: str) -> LocalCopyFile:
        """A best-effort local copy of file ``name`` (see `LocalCopyFile`)."""
        return LocalCopyFile(self.path(name))

    def verified(self, entry: FileEntry) -> str | None:
        """The local path of ``entry`` if its size and checksum match the committed manifest's; else None
        (noted in ``storage``: the caller reads storage)."""
        path = self.path(entry.name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:
                    return self.fell_back(entry.name, f"{size} bytes, the manifest says {entry.size}")
                algorithm, expected = entry.checksum
                if size == 0:
                    digest = checksum(algorithm, b"")
                else:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                        digest = checksum(algorithm, m)
        except FileNotFoundError:
            return self.fell_back(entry.name, "no local copy")
        except OSError as e:
            return self.fell_back(entry.name, f"unreadable: {e}")
        if digest != expected:
            return self.fell_back(entry.name, f"{algorithm} {digest}, the manifest says {expected}")
        self.local.append(entry.name)
        return path

    def fell_back(self, name: str, why: str) -> None:
        """Note that ``name`` is read from storage (and why); returns None."""
        self.storage[name] = why
        return None

    def summary(self) -> str:
        """One line: what each tier served."""
        why = "; ".join(f"{n}: {w}" for n, w in sorted(self.storage.items()))
        return f"{len(self.local)} file(s) from the local tier {self.directory}, {len(self.storage)} from storage" + (
            f" ({why})" if why else ""
        )


class LocalCopyFile:
    """A second, best-effort destination for the bytes of one file being uploaded: a local file written
    atomically (temp file + rename). A failed local write never fails the upload: it is logged and the copy
    dropped (a later load of that file reads storage)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()
        self._f: Any = None
        self.error: BaseException | None = None
        try:
            self._f = self._stack.enter_context(local_atomic_writer(path))
        except Exception as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
            _log.warning("Local tier: no local copy of %s (%s); a restart reads it from storage.", self.path, e)

    def write(self, data: Any) -> None:
        if self._f is not None and self.error is None:
            try:
                self._f.write(data)
            except Exception as e:
                self._fail(e)

    def close(self, ok: bool) -> None:
        """Commit the local file (``ok``: the upload succeeded and nothing failed here), else drop it."""
        if self._f is None:
            return
        self._f = None
        if ok and self.error is None:
            try:
                self._stack.close()
            except Exception as e:
                self._fail(e)
            return
        dropped = self.error or RuntimeError("the upload failed")
        self._stack.__exit__(type(dropped), dropped, None)  # unlinks the temp file, raises nothing


class TeeStream:
    """What ``torch.save`` writes into: the upload stream (``primary``: its errors are the save's) and a
    `LocalCopyFile`. ``error`` is the primary's (torch's zip writer replaces write errors)."""

    def __init__(self, primary: Any, copy: LocalCopyFile) -> None:
        self.primary, self.copy = primary, copy

    @property
    def error(self) -> BaseException | None:
        return getattr(self.primary, "error", None)

    def write(self, data: Any) -> int:
        n = self.primary.write(data)
        self.copy.write(data)
        return int(n) if n is not None else memoryview(data).nbytes

    def flush(self) -> None:
        self.primary.flush()
