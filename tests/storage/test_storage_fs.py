"""fs.py: URL resolution, atomic and create-only writes, error wrapping."""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import os
import socket
import threading
import time

import fsspec
import pytest

from raytrain_events.storage import fs as sfs
from raytrain_events.storage.errors import StorageError


def test_join_handles_slashes():
    assert sfs.join("s3://b/root/", "a", "/b/") == "s3://b/root/a/b"
    assert sfs.join("/tmp/x", "y") == "/tmp/x/y"
    assert sfs.join("memory://", "y") == "memory://y"


def test_resolve_plain_and_file_url_are_the_same_local_path(tmp_path):
    fs1, p1 = sfs.resolve(str(tmp_path))
    fs2, p2 = sfs.resolve(f"file://{tmp_path}")
    assert isinstance(fs1, fsspec.implementations.local.LocalFileSystem)
    assert p1 == p2 == str(tmp_path)


def test_round_trip_and_overwrite(storage):
    url, opts = storage
    fs, root = sfs.resolve(url, opts)
    path = sfs.join(root, "dir", "blob.bin")
    sfs.write_bytes_atomic(fs, path, b"first")
    sfs.write_bytes_atomic(fs, path, b"second")
    assert sfs.read_bytes(fs, path) == b"second"
    with pytest.raises(FileNotFoundError):
        sfs.read_bytes(fs, sfs.join(root, "missing"))


def test_create_only_refuses_existing(storage):
    url, opts = storage
    fs, root = sfs.resolve(url, opts)
    path = sfs.join(root, "lock")
    sfs.write_bytes_create_only(fs, path, b"mine")
    with pytest.raises(FileExistsError):
        sfs.write_bytes_create_only(fs, path, b"theirs")
    assert sfs.read_bytes(fs, path) == b"mine"


def test_create_only_race_has_exactly_one_winner(storage, fast_thread_switching, monkeypatch):
    url, opts = storage
    fs, root = sfs.resolve(url, opts)
    real_exists = type(fs).exists

    def slow_exists(self, *a, **k):  # widens any check-then-write window to 20 ms
        out = real_exists(self, *a, **k)
        time.sleep(0.02)
        return out

    monkeypatch.setattr(type(fs), "exists", slow_exists)
    path = sfs.join(root, "contended")
    n = 12
    barrier = threading.Barrier(n)
    winners: list[int] = []

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            sfs.write_bytes_create_only(fs, path, str(i).encode())
            winners.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert sfs.read_bytes(fs, path) == str(winners[0]).encode()


def test_local_atomic_write_failure_keeps_old_content_and_no_temp_files(tmp_path, monkeypatch):
    fs, root = sfs.resolve(str(tmp_path))
    path = sfs.join(root, "f.bin")
    sfs.write_bytes_atomic(fs, path, b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StorageError, match="disk full"):
        sfs.write_bytes_atomic(fs, path, b"new-but-never-visible")
    monkeypatch.undo()
    assert sfs.read_bytes(fs, path) == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_s3_write_is_one_put_not_a_streamed_open(storage, backend, monkeypatch):
    if backend != "s3":
        pytest.skip("local: temp + os.replace (tested above); memory: one dict assignment")
    url, opts = storage
    fs, root = sfs.resolve(url, opts)
    monkeypatch.setattr(type(fs), "open", lambda *a, **k: pytest.fail("must not stream via open()"))
    sfs.write_bytes_atomic(fs, sfs.join(root, "x"), b"payload")
    monkeypatch.undo()
    assert sfs.read_bytes(fs, sfs.join(root, "x")) == b"payload"


def test_unreachable_s3_endpoint_raises_storage_error_naming_url(monkeypatch):
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    opts = {
        "key": "k",
        "secret": "s",
        "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 0.5, "read_timeout": 0.5, "retries": {"max_attempts": 1}},
    }
    fs, path = sfs.resolve("s3://nowhere-bucket/run", opts)
    # Every connect the client makes to the port (aiohttp's, through the event loop), counted rather than timed:
    # the refusal must surface after the one attempt configured (2 connects seen here: one more inside the client
    # stack), not after a retry loop (max_attempts 4 made 5 connects).
    attempts: list = []
    connect = asyncio.selector_events.BaseSelectorEventLoop.sock_connect

    async def counted(loop, sock, address):
        if address[1] == port:
            attempts.append(address)
        return await connect(loop, sock, address)

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "sock_connect", counted)
    with pytest.raises(StorageError) as info:
        sfs.read_bytes(fs, sfs.join(path, "x"))
    assert "s3://nowhere-bucket/run/x" in str(info.value)
    assert info.value.__cause__ is not None
    assert 1 <= len(attempts) <= 2, attempts


def test_unknown_protocol_is_storage_error():
    with pytest.raises(StorageError, match="nosuchproto://x"):
        sfs.resolve("nosuchproto://x")


def test_missing_backend_package_names_pip_extra(monkeypatch):
    def fake(url, **kw):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", fake)
    with pytest.raises(ImportError, match=r"raytrain_events\[gcs\]"):
        sfs.resolve("gs://bucket/x")


def test_generic_backend_falls_back_to_check_write_verify():
    from fsspec.implementations.dirfs import DirFileSystem

    fs = DirFileSystem(path=f"/fallback-{time.time_ns()}", fs=fsspec.filesystem("memory"))
    sfs.write_bytes_create_only(fs, "lock", b"one")
    with pytest.raises(FileExistsError):
        sfs.write_bytes_create_only(fs, "lock", b"two")
    assert sfs.read_bytes(fs, "lock") == b"one"
