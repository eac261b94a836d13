"""locks.py: create-only run locks, holder-naming errors, stale takeover, races."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from raytrain_events.storage import fs as sfs
from raytrain_events.storage.errors import LockNotHeldError, RunLockedError
from raytrain_events.storage.locks import (
    LockInfo,
    acquire_lock,
    has_lock,
    read_lock,
    refresh_lock,
    release_lock,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists (until reused, which takes a while)
    return proc.pid


def _plant(url: str, opts: dict, lock_type: str, **fields) -> LockInfo:
    """Write a lock file as if another process had taken it."""
    info = LockInfo(
        lock_type=lock_type,
        host=fields.pop("host", socket.gethostname()),
        pid=fields.pop("pid", 1),
        time=fields.pop("time", time.time() - 5),
        token=fields.pop("token", "their-token"),
        **fields,
    )
    fs, path = sfs.resolve(sfs.join(url, lock_type), opts)
    sfs.write_bytes_create_only(fs, path, info.to_bytes())
    return info


def test_lock_content_is_json_with_holder_fields(storage):
    url, opts = storage
    info = acquire_lock(url, "running", storage_options=opts, ttl_s=60)
    fs, path = sfs.resolve(sfs.join(url, "running"), opts)
    d = json.loads(sfs.read_bytes(fs, path))
    assert d["host"] == socket.gethostname() and d["pid"] == os.getpid()
    assert d["token"] == info.token and len(info.token) >= 16
    assert d["expires"] == pytest.approx(d["time"] + 60)
    assert read_lock(url, "running", storage_options=opts) == info


def test_second_acquire_refused_naming_holder_and_fix(storage):
    url, opts = storage
    _plant(url, opts, "running", host="gpu-node-7", pid=4242)
    with pytest.raises(RunLockedError) as e:
        acquire_lock(url, "running", storage_options=opts)
    msg = str(e.value)
    assert "gpu-node-7" in msg and "4242" in msg and "since" in msg
    assert "takeover_stale=True" in msg and "another run" in msg


def test_same_process_second_acquire_refused_unless_exists_ok(storage):
    url, opts = storage
    first = acquire_lock(url, "ckpt", storage_options=opts)
    with pytest.raises(RunLockedError):
        acquire_lock(url, "ckpt", storage_options=opts)
    assert acquire_lock(url, "ckpt", storage_options=opts, exists_ok=True) == first


def test_release_then_reacquire(storage):
    url, opts = storage
    first = acquire_lock(url, "running", storage_options=opts)
    assert has_lock(url, "running", storage_options=opts)
    release_lock(url, "running", storage_options=opts, lock=first)
    assert not has_lock(url, storage_options=opts)
    second = acquire_lock(url, "running", storage_options=opts)
    assert second.token != first.token


def test_release_refuses_someone_elses_lock_unless_forced(storage):
    url, opts = storage
    _plant(url, opts, "running", host="other-host", pid=7)
    with pytest.raises(LockNotHeldError, match="other-host"):
        release_lock(url, "running", storage_options=opts)
    assert has_lock(url, "running", storage_options=opts)
    release_lock(url, "running", storage_options=opts, force=True)
    assert read_lock(url, "running", storage_options=opts) is None
    with pytest.raises(LockNotHeldError, match="missing_ok=True"):
        release_lock(url, "running", storage_options=opts, missing_ok=False)
    release_lock(url, "running", storage_options=opts)  # missing_ok=True by default


def test_has_lock_per_type_and_any(storage):
    url, opts = storage
    assert not has_lock(url, storage_options=opts)
    acquire_lock(url, "scheduled", storage_options=opts)
    assert has_lock(url, storage_options=opts)
    assert has_lock(url, "scheduled", storage_options=opts)
    assert not has_lock(url, "running", storage_options=opts)


def test_stale_lock_of_dead_pid_is_taken_over(storage):
    url, opts = storage
    stale = _plant(url, opts, "running", pid=_dead_pid())
    with pytest.raises(RunLockedError, match="looks stale"):
        acquire_lock(url, "running", storage_options=opts)
    mine = acquire_lock(url, "running", storage_options=opts, takeover_stale=True)
    assert mine.token != stale.token
    assert read_lock(url, "running", storage_options=opts) == mine
    fs, root = sfs.resolve(url, opts)
    leftovers = [sfs.basename(e["name"]) for e in sfs.list_dir(fs, root)]
    assert leftovers == ["running"]  # the takeover claim file was removed


def test_expired_ttl_is_stale_even_on_another_host(storage):
    url, opts = storage
    now = time.time()
    _plant(url, opts, "running", host="elsewhere", pid=1, time=now - 100, ttl_s=10, expires=now - 90)
    mine = acquire_lock(url, "running", storage_options=opts, takeover_stale=True)
    assert read_lock(url, "running", storage_options=opts).token == mine.token


def test_live_lock_is_not_taken_over(storage):
    url, opts = storage
    live = _plant(url, opts, "running", pid=os.getppid())  # our parent is alive
    with pytest.raises(RunLockedError):
        acquire_lock(url, "running", storage_options=opts, takeover_stale=True)
    assert read_lock(url, "running", storage_options=opts).token == live.token


def test_refresh_extends_expiry_and_detects_loss(storage):
    url, opts = storage
    info = acquire_lock(url, "running", storage_options=opts, ttl_s=30)
    time.sleep(0.01)
    renewed = refresh_lock(url, info, storage_options=opts)
    assert renewed.expires > info.expires and renewed.token == info.token
    release_lock(url, "running", storage_options=opts, force=True)
    _plant(url, opts, "running", host="thief")
    with pytest.raises(LockNotHeldError, match="thief"):
        refresh_lock(url, renewed, storage_options=opts)


def _race(n: int, fn) -> tuple[list, list]:
    barrier = threading.Barrier(n)
    wins, losses = [], []

    def run() -> None:
        barrier.wait()
        try:
            wins.append(fn())
        except RunLockedError as e:
            losses.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins, losses


def test_concurrent_acquire_has_exactly_one_winner(storage, fast_thread_switching):
    url, opts = storage
    wins, losses = _race(10, lambda: acquire_lock(url, "running", storage_options=opts))
    assert len(wins) == 1 and len(losses) == 9
    assert read_lock(url, "running", storage_options=opts).token == wins[0].token


def test_concurrent_takeover_has_exactly_one_winner(storage, fast_thread_switching):
    url, opts = storage
    _plant(url, opts, "running", pid=_dead_pid())
    wins, losses = _race(8, lambda: acquire_lock(url, "running", storage_options=opts, takeover_stale=True))
    assert len(wins) == 1 and len(losses) == 7
    assert read_lock(url, "running", storage_options=opts).token == wins[0].token


def test_unreadable_lock_file_still_counts_as_locked(storage):
    url, opts = storage
    fs, path = sfs.resolve(sfs.join(url, "running"), opts)
    sfs.write_bytes_create_only(fs, path, b"")  # e.g. ml-starter's touched lock file
    with pytest.raises(RunLockedError, match="unreadable lock file"):
        acquire_lock(url, "running", storage_options=opts, takeover_stale=True)


def test_unknown_lock_type_is_rejected(storage):
    url, opts = storage
    with pytest.raises(ValueError, match="running"):
        acquire_lock(url, "bogus", storage_options=opts)  # type: ignore[arg-type]


def test_lockinfo_round_trips():
    info = LockInfo("ckpt", "h", 3, 1.5, "tok", 2.0, 3.5)
    assert LockInfo.from_bytes("ckpt", info.to_bytes()) == info
    assert dataclasses.asdict(info)["expires"] == 3.5


def test_lock_create_is_retried_through_a_store_blip(s3_server, caplog):
    """A create-only lock write that times out (the store black-holed for a moment) is retried, and a
    retry that finds its own lock (the first create landed, its reply was lost) takes it as ours."""
    import uuid

    import s3fs

    import raytrain_events.storage.locks as locks
    from tests.faultproxy import FaultProxy, proxied_options

    run = f"s3://{s3_server['bucket']}/lock-blip-{uuid.uuid4().hex[:8]}"
    with FaultProxy(s3_server["endpoint"]) as proxy, pytest.MonkeyPatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "retries", 1)
        options = proxied_options(proxy, s3_server, read_timeout_s=1.0)  # a 2 s write deadline
        creates = []
        real_create = locks.write_bytes_create_only

        def blip_on_first_create(fs, path, data):
            # The blip starts as the first create goes out (not before resolve(), whose time on a
            # loaded machine could use it up): that attempt times out at its 2 s deadline, the
            # retry 0.5 s later goes through.
            creates.append(path)
            if len(creates) == 1:
                proxy.blackhole(2.2)
            real_create(fs, path, data)

        mp.setattr(locks, "write_bytes_create_only", blip_on_first_create)
        with caplog.at_level("WARNING", logger="raytrain_events.storage.locks"):
            lock = acquire_lock(run, "running", storage_options=options)
    assert any("Taking the run lock" in r.message and "attempt 1 of 3" in r.message for r in caplog.records)
    assert read_lock(run, "running", storage_options=s3_server["storage_options"]).token == lock.token
    release_lock(run, "running", storage_options=s3_server["storage_options"], lock=lock)

    # The create landed but its reply was lost: the retry meets the lock with our token.
    calls = []
    real = sfs.write_bytes_create_only

    def lost_reply(fs, path, data):
        calls.append(path)
        real(fs, path, data)
        if len(calls) == 1:
            from raytrain_events.storage.errors import WriteTimeoutError

            raise WriteTimeoutError("reply lost")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(locks, "write_bytes_create_only", lost_reply)
        mp.setattr(locks, "CREATE_BACKOFF_S", 0.01)
        lock = acquire_lock(run, "running", storage_options=s3_server["storage_options"])
    assert (
        len(calls) == 2 and read_lock(run, "running", storage_options=s3_server["storage_options"]).token == lock.token
    )
