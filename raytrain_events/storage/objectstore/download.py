"""Object-store downloads verified while they arrive (the package's docstring has the design).

`fetch_verified` downloads ``[0, size)`` in ``part_size`` ranges, ``concurrency`` at a time and with no HEAD (the
caller knows the size), straight into one preallocated buffer, while the calling thread checksums (CRC32 or sha256)
each range's arrived prefix in order; a wrong size is seen from the first response's headers, before any body is read.
`reader` hands that buffer to ``torch.load`` without another copy. Other filesystems: one ``read_bytes``.
"""

from __future__ import annotations

import asyncio
import functools
import io
import threading
from typing import Any

from raytrain_events.storage._compat import call_s3
from raytrain_events.storage.crc32 import new_checksum
from raytrain_events.storage.errors import StorageError
from raytrain_events.storage.fs import is_s3, read_bytes, storage_error, to_url
from raytrain_events.storage.objectstore.sizes import concurrency, part_size

__all__ = ["fetch_verified", "reader"]

_HASH_STEP = 4 * 2**20  # the hashing thread catches up with a download in steps of this size


class _Progress:
    """Bytes arrived per range, published by the event loop, awaited by the hashing thread."""

    def __init__(self, n: int) -> None:
        self.done = [0] * n
        self.ended = [False] * n
        self.cond = threading.Condition()

    def add(self, i: int, n: int) -> None:
        with self.cond:
            self.done[i] += n
            self.cond.notify_all()

    def end(self, i: int) -> None:
        with self.cond:
            self.ended[i] = True
            self.cond.notify_all()

    def wait(self, i: int, at_least: int) -> int:
        """Bytes of range ``i`` arrived, once at least ``at_least`` did or the range ended."""
        with self.cond:
            while self.done[i] < at_least and not self.ended[i]:
                self.cond.wait()
            return self.done[i]


def fetch_verified(fs: Any, path: str, size: int, algorithm: str = "crc32") -> tuple[Any, int, str | None]:
    """Read ``path``, expected to hold ``size`` bytes: ``(buffer, actual size, hex digest or None)``.

    ``algorithm``: "crc32" or "sha256" (what the file's record says). The digest is None when the size is wrong (then nothing was hashed, and on S3 no body was
    read). FileNotFoundError if the object does not exist; other backend errors are StorageError.
    Wrap the buffer in ``reader`` to hand it to ``torch.load`` without another copy.
    """
    if not is_s3(fs):
        data = read_bytes(fs, path, size_hint=size)
        if len(data) != size:
            return data, len(data), None
        digest = new_checksum(algorithm)
        digest.update(data)
        return data, size, digest.hexdigest()
    return _S3Fetch(fs, path, size, algorithm).run()


def reader(buf: Any) -> io.RawIOBase | io.BytesIO:
    """A seekable binary file over ``buf`` whose ``readinto`` (what torch.load uses) copies once."""
    return io.BytesIO(buf) if isinstance(buf, bytes) else _ViewReader(buf)


class _ViewReader(io.RawIOBase):
    def __init__(self, buf: Any) -> None:
        self._mv = memoryview(buf).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        memoryview(b).cast("B")[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class _S3Fetch:
    """Ranges of ``part_size`` downloaded concurrently into one buffer, hashed in order as
    they arrive. Range 0 goes first: its response says the object's real size, and only if that
    is the expected one are the other ranges requested."""

    def __init__(self, fs: Any, path: str, size: int, algorithm: str) -> None:
        self.fs, self.path, self.size, self.algorithm = fs, path, size, algorithm
        self.bucket, self.key, version = fs.split_path(path)
        self.version = {"VersionId": version} if version else {}
        part = part_size(fs)
        self.ranges = [(a, min(a + part, size)) for a in range(0, size, part)] or [(0, 0)]
        self.buf = bytearray(size)
        self.progress = _Progress(len(self.ranges))
        self.actual = size  # the object's real size, once a response says otherwise

    def run(self) -> tuple[Any, int, str | None]:
        fut = asyncio.run_coroutine_threadsafe(self._download(), self.fs.loop)
        sha = new_checksum(self.algorithm)
        mv = memoryview(self.buf)
        try:
            for i, (a, b) in enumerate(self.ranges):
                hashed = a
                while hashed < b:
                    got = a + self.progress.wait(i, min(hashed + _HASH_STEP, b) - a)
                    if got <= hashed:
                        break  # the range ended early: wrong size or an error, see below
                    sha.update(mv[hashed:got])
                    hashed = got
                if hashed < b:
                    break
            fut.result()  # the download's error, if any
        except BaseException:
            fut.cancel()
            raise
        finally:
            mv.release()
        if self.actual != self.size:
            return self.buf, self.actual, None
        return self.buf, self.size, sha.hexdigest()

    async def _download(self) -> None:
        limit = asyncio.Semaphore(concurrency(self.fs))
        sized = asyncio.Event()
        failed: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                if i:
                    await sized.wait()
                    if self.actual != self.size or failed:
                        return
                async with limit:
                    await self._range(i, sized)
            except BaseException as e:
                failed.append(e)
                raise
            finally:
                if i == 0:
                    sized.set()
                self.progress.end(i)

        try:
            await asyncio.gather(*(one(i) for i in range(len(self.ranges))))
        except (FileNotFoundError, StorageError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise storage_error("reading", to_url(self.fs, self.path), e) from e
        finally:
            for i in range(len(self.ranges)):
                self.progress.end(i)

    async def _range(self, i: int, sized: asyncio.Event) -> None:
        a, b = self.ranges[i]
        pos, attempt = a, 0
        view = memoryview(self.buf)
        try:
            while True:
                ranged = len(self.ranges) > 1 or pos > a
                kw = {"Range": f"bytes={pos}-{b - 1}"} if ranged else {}
                resp = await call_s3(self.fs, "get_object", Bucket=self.bucket, Key=self.key, **self.version, **kw)
                body = resp["Body"]
                try:
                    if pos == a == 0:
                        total = _object_size(resp, ranged=ranged)
                        if total != self.size:
                            self.actual = total
                            return
                        sized.set()
                    while pos < b:
                        n = await body.readinto(view[pos:b])
                        if not n:
                            break
                        pos += n
                        self.progress.add(i, n)
                    if pos < b:  # the body ended before the range did
                        self.actual = min(self.actual, pos)
                    return
                except _resumable():  # connection dropped mid-body: go on from pos
                    attempt += 1
                    if attempt > int(getattr(self.fs, "retries", 5)):
                        raise
                finally:
                    body.close()
        finally:
            view.release()


@functools.cache
def _resumable() -> tuple[type[BaseException], ...]:
    """The errors after which a ranged GET goes on from where its body stopped. Asked for at the first such error,
    not at import: aiohttp and botocore cost ~0.5 s of imports in every process that loads a checkpoint, S3 or not."""
    errors: list[type[BaseException]] = [asyncio.TimeoutError, ConnectionError]
    try:
        from aiohttp import ClientPayloadError
        from botocore.exceptions import ResponseStreamingError

        errors += [ClientPayloadError, ResponseStreamingError]
    except ImportError:
        pass
    return tuple(errors)


def _object_size(resp: dict, *, ranged: bool) -> int:
    """The whole object's size: from ``Content-Range`` (``bytes a-b/TOTAL``) or ``Content-Length``."""
    if ranged:
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return int(resp.get("ContentLength", -1))
