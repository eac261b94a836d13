"""Object-store uploads never wait unbounded (issue 28): the streamed uploads of ``objectstore/``
(single PUT and every request of a multipart upload) have an object-store write's deadline, and
the error past it says what timed out (URL, bytes, deadline) and what to set.

Through `FaultProxy` black-holing the local S3 server mid-upload. The deadline's 1 s/MiB term is
shrunk (``_MIN_WRITE_RATE``) so each test takes seconds: connect 1 s + read 1 s + ~0.1 s per part.
"""

from __future__ import annotations

import uuid

import pytest
import s3fs

from raytrain_events.checkpoint.folder.retry import is_transient
from raytrain_events.storage import fs as sfs
from raytrain_events.storage.errors import StorageError, WriteTimeoutError
from raytrain_events.storage.objectstore import open_upload
from tests.faultproxy import FaultProxy, proxied_options

PART = 5 * 2**20
BLACKHOLE_S = 60.0  # far longer than any deadline here: a wait that is not bounded outlasts it (`proxy.blackholed`)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server["endpoint"]) as p:
        yield p


@pytest.fixture
def fast_deadlines(monkeypatch):
    monkeypatch.setattr(sfs, "_MIN_WRITE_RATE", 64 * 2**20)


def _fs(proxy, s3_server):
    options = {**proxied_options(proxy, s3_server, read_timeout_s=1.0), "default_block_size": PART}
    fs = s3fs.S3FileSystem(**options, max_concurrency=2)
    fs.retries = 1
    return fs, f"{s3_server['bucket']}/deadline-{uuid.uuid4().hex}"


def _check_message(error: BaseException, path: str, what: str) -> None:
    text = str(error)
    assert path in text and what in text, text
    assert "deadline" in text and "read_timeout" in text and "config_kwargs" in text, text
    assert isinstance(error, StorageError) and isinstance(error, TimeoutError) and is_transient(error)


def test_a_multipart_upload_black_holed_midway_fails_at_its_deadline(proxy, s3_server, fast_deadlines):
    fs, path = _fs(proxy, s3_server)
    upload = open_upload(fs, path)
    upload.write(b"a" * (2 * PART))  # starts the multipart upload: create + parts 1 and 2
    for fut in list(upload._inflight):
        fut.result(timeout=60)  # healthy so far
    proxy.blackhole(BLACKHOLE_S)
    with pytest.raises(WriteTimeoutError) as raised:
        upload.write(b"b" * PART)  # part 3 goes into the black hole
        upload.finish()
    # Failed at part 3's deadline (~2.2 s) plus the abort's (~2 s): while the hole still swallowed everything.
    assert proxy.blackholed
    _check_message(raised.value, path, "part 3 (5242880 bytes) of a multipart upload")
    assert raised.value.nbytes == PART and 2.0 < raised.value.deadline_s < 3.0  # 2 parts in flight: 10 MiB counted
    proxy.heal()
    assert not fs.exists(path)  # nothing committed


def test_a_black_holed_single_put_fails_at_its_deadline_naming_url_and_size(proxy, s3_server, fast_deadlines):
    fs, path = _fs(proxy, s3_server)
    upload = open_upload(fs, path)
    upload.write(b"c" * 1000)
    proxy.blackhole(BLACKHOLE_S)
    with pytest.raises(WriteTimeoutError) as raised:
        upload.finish()
    assert proxy.blackholed  # failed at its deadline, while the hole still swallowed everything
    _check_message(raised.value, path, "1000 bytes")


def test_write_bytes_atomic_past_its_deadline_says_what_timed_out(proxy, s3_server, fast_deadlines):
    fs, path = _fs(proxy, s3_server)
    proxy.blackhole(BLACKHOLE_S)
    with pytest.raises(WriteTimeoutError) as raised:
        sfs.write_bytes_atomic(fs, path, b"d" * 2048)
    _check_message(raised.value, path, "2048 bytes")
    assert "FSTimeoutError" in repr(raised.value.__cause__)  # fsspec's, whose own message is empty
