"""Retrying a checkpoint's uploads through an object store's bad minutes: backoff, then a deadline.

s3fs retries a single request a few times within seconds; an outage (a black-holed network, a
burst of ``503 SlowDown``, connections cut mid-multipart-upload) outlasts that. A background
save retries its whole upload-and-commit with exponential backoff (0.5 s doubling to 30 s)
until ``CheckpointConfig.upload_deadline_s`` has passed since its first attempt, then fails for
good (the `Checkpointer` reports it and the next save tries again).

Retried: transient I/O (``ConnectionError``, timeouts, ``StorageError`` and other ``OSError``s,
botocore/aiohttp errors), and the object store's own "try again" answers: an HTTP 5xx or a
throttling code (``503 SlowDown``, which s3fs turns into ``OSError(EBUSY)`` caused by botocore's
``ClientError`` -- a ``ClientError`` is not a ``BotoCoreError``, so it once failed the save at once). Not retried: errors a retry cannot fix -- a missing file or bucket,
denied access, a full or read-only disk, and our own ``CheckpointError``s (an unsafe or
mismatched checkpoint) -- they fail at once. Retrying is safe because a checkpoint directory is
new for each save, payload uploads are atomic overwrites, and the commit (the manifest) is
create-only: a retry after a commit whose reply was lost finds the manifest and stops.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from raytrain_events.checkpoint.format.manifest import CheckpointError

__all__ = ["is_transient", "retry_storage"]

T = TypeVar("T")
_log = logging.getLogger(__name__)
_PERMANENT_OS = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
_PERMANENT_ERRNO = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.ENOENT}
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE}
# S3's "slow down / try again" error codes (returned with 503, or 400 for some throttles)
_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}


def _library_transient() -> tuple[type[BaseException], ...]:
    """The transient errors of the libraries loaded so far: an error of botocore's or aiohttp's can only have been
    raised where they are imported, and importing them here (~0.5 s) would tax every process that saves."""
    found: list[type[BaseException]] = [asyncio.TimeoutError, ConnectionError, TimeoutError]
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        found.append(botocore.BotoCoreError)
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and hasattr(aiohttp, "ClientError"):
        found.append(aiohttp.ClientError)
    return tuple(found)


def is_transient(error: BaseException) -> bool:
    """True if retrying later may succeed (see the module docstring)."""
    seen = set()
    while error is not None and id(error) not in seen:  # a StorageError wraps the library's error
        seen.add(id(error))
        if isinstance(error, CheckpointError) or isinstance(error, _PERMANENT_OS):
            return False
        if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNO:
            return False
        if isinstance(error, _library_transient()):
            return True
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNO:
            return True
        response = getattr(error, "response", None)  # botocore's ClientError: the store's answer
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            return response["Error"].get("Code") in _RETRY_CODES or int(status) >= 500
        if isinstance(error, OSError):
            cause = error.__cause__ or error.__context__
            if cause is None:
                return True
            error = cause
            continue
        return False
    return False


def retry_storage(
    fn: Callable[[], T],
    *,
    deadline_s: float,
    what: str,
    first_delay_s: float = 0.5,
    max_delay_s: float = 30.0,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """``fn()``, retried with exponential backoff while it fails transiently, until ``deadline_s``."""
    start, delay, attempt = time.monotonic(), first_delay_s, 1
    while True:
        try:
            return fn()
        except Exception as e:
            left = deadline_s - (time.monotonic() - start)
            if not is_transient(e) or left <= 0:
                raise
            wait = min(delay, max_delay_s, left)
            _log.warning("Uploading %s failed (attempt %d: %s); retrying in %.1f s", what, attempt, e, wait)
            sleep(wait)
            delay, attempt = delay * 2, attempt + 1
