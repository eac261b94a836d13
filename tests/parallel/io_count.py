"""Count what a rank reads from storage, at the fsspec layer (for the read-cost tests and bench).

`count_s3_reads()` counts the bytes each S3 object key served (s3fs's one API entry, ``_call_s3``:
each ``get_object`` response's ContentLength), per key's last path part, in this process only.

`count_reads()` patches, in this process only, fsspec's ``AbstractFileSystem.open`` (every
``.metadata`` opened for reading, on any filesystem) and the local file object's ``read`` /
``readinto`` (bytes read from each file:// file, by DCP's stream reads and by the ranged reads,
which fsspec's ``cat_file`` serves through the same object).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Any, Dict, Iterator


class ReadCounts:
    """``metadata_opens``: ``.metadata`` opened for reading; ``bytes``: bytes read per file name."""

    def __init__(self) -> None:
        self.metadata_opens = 0
        self.bytes: Counter = Counter()

    def as_dict(self) -> Dict[str, Any]:
        return {"metadata_opens": self.metadata_opens, "bytes": dict(self.bytes)}


@contextlib.contextmanager
def count_reads() -> Iterator[ReadCounts]:
    from fsspec.implementations.local import LocalFileOpener
    from fsspec.spec import AbstractFileSystem

    counts = ReadCounts()
    open_, read = AbstractFileSystem.open, LocalFileOpener.read

    def counting_open(self: Any, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and str(path).endswith(".metadata"):
            counts.metadata_opens += 1
        return open_(self, path, mode, *args, **kwargs)

    def counting_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = read(self, *args, **kwargs)
        counts.bytes[os.path.basename(self.path)] += len(data)
        return data

    def counting_readinto(self: Any, buffer: Any) -> Any:
        n = self.f.readinto(buffer)
        counts.bytes[os.path.basename(self.path)] += n or 0
        return n

    AbstractFileSystem.open = counting_open  # type: ignore[method-assign]
    LocalFileOpener.read = counting_read  # type: ignore[method-assign]
    LocalFileOpener.readinto = counting_readinto  # type: ignore[attr-defined]
    try:
        yield counts
    finally:
        AbstractFileSystem.open = open_  # type: ignore[method-assign]
        LocalFileOpener.read = read  # type: ignore[method-assign]
        del LocalFileOpener.readinto


@contextlib.contextmanager
def count_s3_reads() -> Iterator[Counter]:
    import s3fs

    counts: Counter = Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counting(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await real(self, method, *args, **kwargs)
        if method == "get_object":
            counts[str(kwargs.get("Key", "")).rsplit("/", 1)[-1]] += int(out.get("ContentLength") or 0)
        return out

    s3fs.S3FileSystem._call_s3 = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        s3fs.S3FileSystem._call_s3 = real  # type: ignore[method-assign]


def payload_bytes(counts: Counter) -> int:
    """Bytes of checkpoint payload files (state, RNGs, DCP shards and metadata) in ``counts``: not the
    manifests, the index or lock files."""
    return sum(n for key, n in counts.items() if key.endswith((".pt", ".distcp", ".metadata")))
