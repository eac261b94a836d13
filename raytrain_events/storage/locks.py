"""Run-directory lock files (``running``, ``scheduled``, ``ckpt``), in ml-starter's style.

A lock is a small JSON object ``{"lock_type", "host", "pid", "time", "token", "ttl_s",
"expires"}`` at ``<run dir>/<lock type>``. It is created CREATE-ONLY, decided by the
backend itself rather than by check-then-write (see ``fs.write_bytes_create_only``):

* local files: the complete lock is written to a temp file and hard-linked into place
  (``os.link`` fails if the name exists; ``open(path, "x")`` is the fallback);
* ``memory://``: ``dict.setdefault`` on the in-process store (atomic under the GIL);
* S3: a conditional PUT with ``If-None-Match: *`` (s3fs ``mode="create"``; honoured by AWS
  S3, MinIO and moto, which answer 412 when the key exists);
* other fsspec backends: exists-check + write + read-back of our unique token. Two
  processes racing inside that window can both believe they won.

A lock is *stale* when its ttl expired, or when it was taken on this host by a pid that no
longer exists (hosts are compared by hostname: containers that share a hostname but not a
pid namespace must use ``ttl_s`` instead). ``acquire_lock(..., takeover_stale=True)``
replaces a stale lock: the taker first create-only writes a claim file named after the stale
lock's token, so of several concurrent takers exactly one proceeds to delete the stale lock
and create-only write its own. Remaining windows, all needing an unusual interleaving:
``release_lock`` and ``takeover`` read-then-delete, so a lock released and freshly re-taken
within those few milliseconds can be deleted by them; a claim file left by a taker that
crashed is ignored after ``CLAIM_TTL_S``.

Usage::

    info = acquire_lock("s3://bucket/runs/run_3", "running", ttl_s=3600)
    ...
    release_lock("s3://bucket/runs/run_3", "running", lock=info)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Literal

from raytrain_events.storage.errors import LockNotHeldError, RunLockedError, WriteTimeoutError
from raytrain_events.storage.fs import (
    basename,
    delete,
    join,
    list_dir,
    read_bytes,
    resolve,
    write_bytes_atomic,
    write_bytes_create_only,
)

LockType = Literal["running", "scheduled", "ckpt"]
LOCK_TYPES: tuple[str, ...] = ("running", "scheduled", "ckpt")
CLAIM_TTL_S = 60.0
CREATE_ATTEMPTS = 3  # a lock's create-only write, through a store's short blip
CREATE_BACKOFF_S = 0.5
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LockInfo:
    """The content of one lock file. ``token`` identifies the acquisition uniquely."""

    lock_type: str
    host: str
    pid: int
    time: float
    token: str
    ttl_s: float | None = None
    expires: float | None = None

    def is_ours(self) -> bool:
        """Taken by this very process (same host and pid)."""
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def stale_reason(self, *, now: float | None = None) -> str | None:
        """Why the lock can be taken over, or None while it is live."""
        now = time.time() if now is None else now
        if self.expires is not None and now > self.expires:
            return f"its ttl expired {now - self.expires:.0f}s ago"
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return f"pid {self.pid} no longer exists on this host"
        return None

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.time).isoformat(timespec="seconds")
        age = time.time() - self.time
        text = f"host {self.host!r} pid {self.pid} since {since} ({age:.0f}s ago)"
        if self.expires is not None:
            text += f", expires in {self.expires - time.time():.0f}s"
        return text

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, lock_type: str, raw: bytes) -> LockInfo:
        try:
            d = json.loads(raw)
            return cls(
                lock_type=lock_type,
                host=str(d["host"]),
                pid=int(d["pid"]),
                time=float(d["time"]),
                token=str(d["token"]),
                ttl_s=d.get("ttl_s"),
                expires=d.get("expires"),
            )
        except (ValueError, KeyError, TypeError):  # empty (e.g. `touch`ed) or foreign file
            digest = hashlib.sha256(raw).hexdigest()[:16]
            return cls(lock_type=lock_type, host="<unreadable lock file>", pid=-1, time=0.0, token=f"raw-{digest}")


def acquire_lock(
    run_url: str,
    lock_type: LockType,
    *,
    storage_options: dict[str, Any] | None = None,
    ttl_s: float | None = None,
    exists_ok: bool = False,
    takeover_stale: bool = False,
) -> LockInfo:
    """Create the ``lock_type`` lock in ``run_url`` or raise RunLockedError naming the holder.

    ``exists_ok``: if this same process already holds the lock, return that lock instead of
    raising (a lock held by anyone else still raises). ``takeover_stale``: replace a stale
    lock (holder dead on this host, or ttl expired) instead of raising.
    """
    _check_type(lock_type)
    fs, run_path = resolve(run_url, storage_options)
    path = join(run_path, lock_type)
    now = time.time()
    mine = LockInfo(
        lock_type=lock_type,
        host=socket.gethostname(),
        pid=os.getpid(),
        time=now,
        token=uuid.uuid4().hex,
        ttl_s=ttl_s,
        expires=None if ttl_s is None else now + ttl_s,
    )
    for _ in range(5):  # retries only when the holder vanished between our create and read
        try:
            _create_retrying(fs, path, mine.to_bytes(), run_url)
            return mine
        except FileExistsError:
            pass
        current = _read(fs, path, lock_type)
        if current is None:
            continue
        if current.token == mine.token:  # our create landed, its reply was lost (then retried)
            return mine
        if exists_ok and current.is_ours():
            return current
        reason = current.stale_reason()
        if takeover_stale and reason is not None:
            return _takeover(fs, run_path, run_url, current, mine)
        raise RunLockedError(_locked_message(run_url, current, reason))
    raise RunLockedError(
        f"Could not acquire the {lock_type!r} lock in {run_url!r}: other processes keep "
        "taking and releasing it. Fix: retry later or use a different run directory."
    )


def _create_retrying(fs: Any, path: str, data: bytes, run_url: str) -> None:
    """Create-only write of a lock, retried through a store's short blip (a request that timed out
    or a connection refused/reset): ``CREATE_ATTEMPTS`` tries, ``CREATE_BACKOFF_S`` doubling. A
    create whose reply was lost may have landed: the caller's retry then meets its own token."""
    delay = CREATE_BACKOFF_S
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            write_bytes_create_only(fs, path, data)
            return
        except FileExistsError:
            raise
        except (WriteTimeoutError, ConnectionError) as e:
            if attempt == CREATE_ATTEMPTS:
                raise
            _log.warning(
                "Taking the run lock in %s failed (attempt %d of %d: %s); retrying in %.1f s.",
                run_url,
                attempt,
                CREATE_ATTEMPTS,
                type(e).__name__,
                delay,
            )
            time.sleep(delay)
            delay *= 2


def release_lock(
    run_url: str,
    lock_type: LockType,
    *,
    storage_options: dict[str, Any] | None = None,
    lock: LockInfo | None = None,
    force: bool = False,
    missing_ok: bool = True,
) -> None:
    """Remove the lock if it is ours: same token as ``lock``, else same host and pid.

    ``force`` removes whoever holds it. Raises LockNotHeldError when it is someone else's.
    """
    _check_type(lock_type)
    fs, run_path = resolve(run_url, storage_options)
    path = join(run_path, lock_type)
    current = _read(fs, path, lock_type)
    if current is None:
        if missing_ok:
            return
        raise LockNotHeldError(
            f"No {lock_type!r} lock exists in {run_url!r}, so there is nothing to release. Fix: pass missing_ok=True."
        )
    ours = current.token == lock.token if lock is not None else current.is_ours()
    if not (ours or force):
        raise LockNotHeldError(
            f"The {lock_type!r} lock in {run_url!r} is held by {current.describe()}, not by "
            "this caller, so it was left in place. Fix: pass the LockInfo returned by "
            "acquire_lock, or force=True if you are sure that holder is gone."
        )
    delete(fs, path)


def refresh_lock(run_url: str, lock: LockInfo, *, storage_options: dict[str, Any] | None = None) -> LockInfo:
    """Push a ttl lock's expiry forward (call periodically from a long run); same token."""
    if lock.ttl_s is None:
        return lock
    fs, run_path = resolve(run_url, storage_options)
    path = join(run_path, lock.lock_type)
    current = _read(fs, path, lock.lock_type)
    if current is None or current.token != lock.token:
        holder = current.describe() if current else "nobody"
        raise LockNotHeldError(
            f"Cannot refresh the {lock.lock_type!r} lock in {run_url!r}: it is now held by "
            f"{holder} (ours expired and was taken over?). Fix: stop writing to this run."
        )
    renewed = dataclasses.replace(lock, expires=time.time() + lock.ttl_s)
    write_bytes_atomic(fs, path, renewed.to_bytes())
    return renewed


def read_lock(run_url: str, lock_type: LockType, *, storage_options: dict[str, Any] | None = None) -> LockInfo | None:
    """The current lock of ``lock_type`` in ``run_url``, or None."""
    _check_type(lock_type)
    fs, run_path = resolve(run_url, storage_options)
    return _read(fs, join(run_path, lock_type), lock_type)


def has_lock(run_url: str, lock_type: LockType | None = None, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``run_url`` holds a lock of ``lock_type`` (any of the three when None)."""
    types = LOCK_TYPES if lock_type is None else (_check_type(lock_type),)
    fs, run_path = resolve(run_url, storage_options)
    names = {basename(e["name"]) for e in list_dir(fs, run_path) if e.get("type") != "directory"}
    return any(t in names for t in types)


def _takeover(fs: Any, run_path: str, run_url: str, stale: LockInfo, mine: LockInfo) -> LockInfo:
    path = join(run_path, stale.lock_type)
    claim = join(run_path, f".{stale.lock_type}.takeover-{stale.token}")
    try:
        write_bytes_create_only(fs, claim, mine.to_bytes())
    except FileExistsError:
        other = _read(fs, claim, stale.lock_type)
        if other is not None and time.time() - other.time > CLAIM_TTL_S:
            delete(fs, claim)  # a taker crashed mid-takeover; let the next attempt proceed
        raise RunLockedError(
            f"Another process is taking over the stale {stale.lock_type!r} lock in "
            f"{run_url!r} right now. Fix: wait and retry, or choose another run directory."
        ) from None
    try:
        current = _read(fs, path, stale.lock_type)
        if current is not None:
            if current.token != stale.token:
                raise RunLockedError(_locked_message(run_url, current, current.stale_reason()))
            delete(fs, path)
        try:
            write_bytes_create_only(fs, path, mine.to_bytes())
        except FileExistsError:
            holder = _read(fs, path, stale.lock_type)
            raise RunLockedError(_locked_message(run_url, holder, None)) from None
        return mine
    finally:
        delete(fs, claim)


def _read(fs: Any, path: str, lock_type: str) -> LockInfo | None:
    try:
        return LockInfo.from_bytes(lock_type, read_bytes(fs, path))
    except FileNotFoundError:
        return None


def _locked_message(run_url: str, holder: LockInfo | None, stale_reason: str | None) -> str:
    who = holder.describe() if holder is not None else "another process"
    kind = holder.lock_type if holder is not None else "run"
    msg = f"Run directory {run_url!r} is locked ({kind!r}) by {who}."
    if stale_reason is not None:
        return msg + (
            f" The lock looks stale ({stale_reason}). Fix: pass takeover_stale=True "
            "to take it over, or choose another run directory."
        )
    return msg + (
        " Fix: wait for that run to finish, choose another run name/directory, or "
        "pass takeover_stale=True (replaces the lock once its holder is dead on this "
        "host or its ttl expired); release_lock(..., force=True) removes it outright."
    )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _check_type(lock_type: str) -> str:
    if lock_type not in LOCK_TYPES:
        raise ValueError(f"Unknown lock type {lock_type!r}. Fix: use one of {LOCK_TYPES}.")
    return lock_type
