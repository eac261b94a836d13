"""Object-store transfers for large immutable files: uploads fed while the bytes are produced,
CRC32ed once, in parallel parts; downloads in parallel ranges, verified while they arrive.

Why not ``fs.pipe_file`` / ``fs.cat_file``: they need the whole content first and hash nothing.
Here (S3 through s3fs's own retrying call path, reached through ``storage/_compat.py``):

* ``open_upload`` gives a write-only file for ``torch.save`` whose checksum is the file's CRC32
  (``hexdigest()``), computed once and sent with the requests: botocore would otherwise CRC32 every
  request body itself, so the store verifies what we serialized and nothing is checksummed twice.
  Below ``2 * part_size`` nothing is sent until ``finish``, which CRC32s the bytes and sends one
  PUT (as s3fs's pipe would) carrying ``ChecksumCRC32``. From ``2 * part_size`` on it starts a
  multipart upload and sends each full part at once, up to ``fs.max_concurrency`` parts in flight
  on fsspec's event loop, while ``torch.save`` keeps producing the next ones (back-pressure bounds
  memory to ``max_concurrency + 2`` parts). Each part's CRC32 runs on a worker thread of that loop
  (``zlib`` releases the GIL) and goes with its ``UploadPart``; the file's CRC32 is combined from
  the parts' (``crc32_combine``), so the thread producing the bytes hashes nothing at all.
  ``finish`` completes the upload: the object appears whole or not at all. ``abort`` (and any
  error) aborts it, so no part is left billed; a killed process leaves an incomplete upload,
  invisible (a lifecycle rule reclaims it).
* ``fetch_verified`` downloads ``[0, size)`` in ``part_size`` ranges (``fs.max_concurrency`` at a
  time, no HEAD: the caller knows the size) straight into one preallocated buffer, while the
  calling thread checksums (CRC32 or sha256, as the caller asks) each range's arrived prefix in
  order. A size mismatch is seen from the first response's ``Content-Length``/``Content-Range``,
  before reading the body.

``part_size`` is ``fs.default_block_size`` (s3fs: 50 MiB; the ``default_block_size`` storage
option) and the concurrency ``fs.max_concurrency`` (s3fs: 10; the ``max_concurrency`` option): the
knobs s3fs already has for the same trade-off. Other filesystems get the same interface over a
memory buffer and one ``write_bytes_atomic`` / ``read_bytes``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import io
import threading
import time
import zlib
from typing import Any

from raytrain_events.storage._compat import call_s3, pipe_file
from raytrain_events.storage.crc32 import Crc32, crc32_combine, new_checksum, s3_checksum
from raytrain_events.storage.errors import StorageError
from raytrain_events.storage.fs import (
    is_s3,
    read_bytes,
    storage_error,
    to_url,
    write_bytes_atomic,
    write_timeout_error,
    write_timeout_s,
)

_HASH_STEP = 4 * 2**20  # the hashing thread catches up with a download in steps of this size
_MIN_PART = 5 * 2**20  # S3's smallest non-final part


def part_size(fs: Any) -> int:
    return max(_MIN_PART, int(getattr(fs, "default_block_size", 0) or 50 * 2**20))


def concurrency(fs: Any) -> int:
    return max(1, int(getattr(fs, "max_concurrency", 1) or 1))


def open_upload(fs: Any, path: str) -> ObjectUpload:
    """A write-only, CRC32ing file whose content becomes ``path`` on ``finish()``."""
    return _S3Upload(fs, path) if is_s3(fs) else ObjectUpload(fs, path)


class ObjectUpload:
    """Buffers everything in memory, CRC32ing each write; ``finish`` writes it atomically."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path, self.url = fs, path, to_url(fs, path)
        self.size = 0
        self.error: BaseException | None = None  # torch's zip writer replaces write errors
        self._crc = Crc32()
        self._buf = io.BytesIO()

    def write(self, data: Any) -> int:
        self._crc.update(data)
        n = self._buf.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._crc.hexdigest()

    def finish(self) -> None:
        write_bytes_atomic(self.fs, self.path, self._buf.getvalue())
        self._buf = io.BytesIO()

    def abort(self) -> None:
        self._buf = io.BytesIO()


class _S3Upload(ObjectUpload):
    """Single PUT below ``2 * part_size``, else a multipart upload fed while writing."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self._part = part_size(fs)
        self._max_inflight = concurrency(fs)
        self._bucket, self._key, _ = fs.split_path(path)
        self._mpu: concurrent.futures.Future | None = None  # -> UploadId
        self._inflight: collections.deque[concurrent.futures.Future] = collections.deque()
        self._parts: dict[int, concurrent.futures.Future] = {}  # -> (ETag, CRC32, size)
        self._deadlines: dict[concurrent.futures.Future, tuple] = {}  # (time, seconds, bytes, what): `_wait`
        self._cur: bytearray | None = None  # the part being filled, once multipart (reused)
        self._pos = 0
        self._aborted = False

    def write(self, data: Any) -> int:
        if self.error is not None:
            raise self.error
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        self.size += n
        if self._cur is None:  # CRC32ed in finish(), before the PUT
            self._buf.write(mv)
            if self._buf.tell() >= 2 * self._part:
                self._start_multipart()
            return n
        while mv.nbytes:  # multipart: each part is CRC32ed beside its upload (_send)
            take = min(mv.nbytes, self._part - self._pos)
            self._cur[self._pos : self._pos + take] = mv[:take]
            self._pos += take
            mv = mv[take:]
            if self._pos == self._part:
                self._send(bytes(self._cur))
                self._pos = 0
        return n

    def finish(self) -> None:
        if self._cur is None:  # small: one PUT (as s3fs.pipe_file) carrying our CRC32
            data = self._buf.getvalue()
            self._buf = io.BytesIO()
            self._crc.update(data)
            checksum = s3_checksum(self._crc.value)
            put = self._run(pipe_file(self.fs, self.path, data, chunksize=self._part, ChecksumCRC32=checksum))
            try:
                self._wait(put, self._deadline(len(data)))
            except BaseException as e:
                wrapped = self._wrap(e)
                if wrapped is e:
                    raise
                raise wrapped from e
            return
        try:
            if self._pos:
                with memoryview(self._cur) as filled:
                    self._send(bytes(filled[: self._pos]))
            self._cur = None
            parts, crc = [], 0
            for i, f in sorted(self._parts.items()):
                etag, part_crc, size = self._wait(f)
                parts.append({"PartNumber": i, "ETag": etag})
                crc = crc32_combine(crc, part_crc, size) if i > 1 else part_crc
            self._crc.value = crc
            complete = self._run(
                call_s3(
                    self.fs,
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id(),
                    MultipartUpload={"Parts": parts},
                )
            )
            self._wait(complete, self._deadline(0, "the multipart upload's completion"))
            self.fs.invalidate_cache(self.path)
        except BaseException as e:
            self.abort()
            wrapped = self._wrap(e)
            if wrapped is e:
                raise
            raise wrapped from e

    def abort(self) -> None:
        """Stop sending and abort the multipart upload (best effort; never raises).

        Parts not yet sent are dropped; parts being sent are waited for until their deadline (then
        cancelled), since S3 may keep a part that finishes after the abort."""
        self._buf, self._cur, self._aborted = io.BytesIO(), None, True
        last = max((self._deadlines[f][0] for f in self._inflight), default=0.0)
        _, late = concurrent.futures.wait(self._inflight, timeout=max(0.0, last - time.monotonic()))
        for fut in late:  # past their deadline (black-holed): cancel them
            fut.cancel()
        self._inflight.clear()
        if self._mpu is not None:
            try:
                upload_id = self._upload_id()
                stop = self._run(
                    call_s3(self.fs, "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
                )
                self._wait(stop, self._deadline(0, "the multipart upload's abort"))
            except Exception:  # the upload stays incomplete: invisible, reclaimed by lifecycle
                pass
            self._mpu = None

    # -- internals
    def _start_multipart(self) -> None:
        async def create() -> str:
            out = await call_s3(self.fs, "create_multipart_upload", Bucket=self._bucket, Key=self._key)
            return out["UploadId"]

        self._mpu = self._run(create())
        self._deadlines[self._mpu] = self._deadline(0, "the multipart upload's creation")
        data = self._buf.getbuffer()
        whole = len(data) // self._part
        for i in range(whole):
            self._send(bytes(data[i * self._part : (i + 1) * self._part]))
        rest = data[whole * self._part :]
        self._cur, self._pos = bytearray(self._part), len(rest)
        self._cur[: len(rest)] = rest
        del data, rest
        self._buf = io.BytesIO()

    def _send(self, body: bytes) -> None:
        """Upload ``body`` as the next part. ``bytes``, not the ``bytearray`` it was filled in:
        aiobotocore sends a 50 MiB ``bytearray`` part ~90 ms slower (~0.1 s more CPU), measured
        against moto, while the copy to ``bytes`` costs ~10 ms."""
        while len(self._inflight) >= self._max_inflight:  # back-pressure: bounded memory
            self._check(self._inflight.popleft())
        number = len(self._parts) + 1
        mpu = self._mpu

        async def upload() -> tuple[str, int, int]:
            crc = await asyncio.get_running_loop().run_in_executor(None, zlib.crc32, body)  # beside other parts
            upload_id = await asyncio.shield(asyncio.wrap_future(mpu))  # never cancel the create
            if self._aborted:
                raise asyncio.CancelledError(f"part {number}: upload aborted")
            out = await call_s3(
                self.fs,
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ChecksumCRC32=s3_checksum(crc),
            )
            return out["ETag"], crc, len(body)

        fut = self._run(upload())
        self._parts[number] = fut  # the parts in flight share the bandwidth: each's deadline counts them
        what = f"part {number} ({len(body)} bytes) of a multipart upload"
        self._deadlines[fut] = self._deadline(len(body) * (len(self._inflight) + 1), what, len(body))
        self._inflight.append(fut)
        while self._inflight and self._inflight[0].done():
            self._check(self._inflight.popleft())

    def _check(self, fut: concurrent.futures.Future) -> None:
        try:
            self._wait(fut)
        except BaseException as e:
            self.error = self._wrap(e)
            self.abort()
            if self.error is e:
                raise
            raise self.error from e

    def _upload_id(self) -> str:
        assert self._mpu is not None
        return self._wait(self._mpu)

    def _deadline(self, counted: int, what: str = "", nbytes: int | None = None) -> tuple:
        seconds = write_timeout_s(self.fs, counted)
        return time.monotonic() + seconds, seconds, counted if nbytes is None else nbytes, what

    def _wait(self, fut: concurrent.futures.Future, deadline: tuple | None = None) -> Any:
        """``fut.result()``, or past its deadline (an object-store write's, ``fs.write_timeout_s``; a part
        counts the parts in flight beside it) cancel the request and raise ``WriteTimeoutError``."""
        at, seconds, nbytes, what = deadline or self._deadlines[fut]
        try:
            return fut.result(timeout=max(0.0, at - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if fut.done():  # the request's own timeout, not ours
                raise
            fut.cancel()
            raise write_timeout_error(self.fs, self.path, nbytes, seconds, what) from None

    def _run(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def _wrap(self, e: BaseException) -> BaseException:
        if isinstance(e, (StorageError, FileNotFoundError)) or not isinstance(e, Exception):
            return e
        return storage_error("writing", self.url, e)


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
                except _RESUMABLE:  # connection dropped mid-body: go on from pos
                    attempt += 1
                    if attempt > int(getattr(self.fs, "retries", 5)):
                        raise
                finally:
                    body.close()
        finally:
            view.release()


def _resumable() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [asyncio.TimeoutError, ConnectionError]
    try:
        from aiohttp import ClientPayloadError
        from botocore.exceptions import ResponseStreamingError

        errors += [ClientPayloadError, ResponseStreamingError]
    except ImportError:
        pass
    return tuple(errors)


_RESUMABLE = _resumable()


def _object_size(resp: dict, *, ranged: bool) -> int:
    """The whole object's size: from ``Content-Range`` (``bytes a-b/TOTAL``) or ``Content-Length``."""
    if ranged:
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return int(resp.get("ContentLength", -1))
