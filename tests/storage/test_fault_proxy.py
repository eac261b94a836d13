"""`FaultProxy` itself: each fault does what it says, seen through s3fs against the local S3 server."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import s3fs

from tests.faultproxy import FaultProxy, proxied_options

SIZE = 300_000


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server["endpoint"]) as p:
        yield p


def _fs(proxy, s3_server, **kw):
    fs = s3fs.S3FileSystem(**proxied_options(proxy, s3_server, **kw))
    fs.retries = 1  # s3fs's own retries off: each fault reaches the test at once
    return fs


def _path(s3_server):
    return f"{s3_server['bucket']}/proxy-{uuid.uuid4().hex}"


def test_passes_traffic_through_when_healthy(proxy, s3_server):
    fs, path = _fs(proxy, s3_server), _path(s3_server)
    fs.pipe(path, b"x" * SIZE)
    assert fs.cat(path) == b"x" * SIZE and proxy.requests >= 2


def test_slowdown_answers_503_to_the_next_k_requests(proxy, s3_server):
    fs, path = _fs(proxy, s3_server), _path(s3_server)
    proxy.slowdown(2)
    for _ in range(2):
        with pytest.raises(OSError) as raised:
            fs.pipe(path, b"y" * SIZE)
        assert "SlowDown" in repr(raised.value.__cause__) or "reduce your request rate" in str(raised.value)
    fs.pipe(path, b"y" * SIZE)  # the third goes through
    assert proxy.slowdowns_sent == 2 and fs.cat(path) == b"y" * SIZE


def test_cut_resets_a_connection_mid_upload(proxy, s3_server):
    fs, path = _fs(proxy, s3_server), _path(s3_server)
    fs.ls(s3_server["bucket"])  # an open connection, then cut every upload after 10 kB of it
    proxy.cut(after_bytes=10_000)
    with pytest.raises(Exception):  # aiohttp retries a request on a fresh connection once: cut too
        fs.pipe(path, b"z" * SIZE)
    assert proxy.cuts_done >= 1
    proxy.heal()
    assert not fs.exists(path)  # the truncated upload stored nothing
    cuts = proxy.cuts_done
    proxy.cut(after_bytes=10_000, times=1)
    fs.pipe(path, b"z" * SIZE)  # one cut: the HTTP client's own retry gets through
    assert proxy.cuts_done == cuts + 1 and fs.cat(path) == b"z" * SIZE


def test_cut_open_connections_resets_every_open_connection(proxy):
    # A connection held open by an unfinished request (a keep-alive connection after a request
    # was racy: the moto server closes connections after each answer, sometimes before the cut).
    port = int(proxy.endpoint.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline, cut = time.monotonic() + 5, 0
        while not cut and time.monotonic() < deadline:  # until the proxy has accepted it
            cut = proxy.cut_open_connections()
            time.sleep(0.02)
        assert cut == 1
        with pytest.raises(ConnectionResetError):  # an RST, as a cut network path gives
            client.recv(1)


def test_blackhole_times_the_client_out_then_heals(proxy, s3_server):
    fs, path = _fs(proxy, s3_server, read_timeout_s=1.0), _path(s3_server)
    fs.pipe(path, b"w")
    # A hole far longer than the client's read timeout (a 3 s hole against the 1 s timeout raced on a
    # loaded machine: a client starved for 2 s more reached the hole's end and counted as answered).
    proxy.blackhole(60.0)
    start = time.monotonic()
    with pytest.raises(Exception):
        fs.cat(path)
    took = time.monotonic() - start
    assert proxy.blackholed and 0.9 <= took < 60.0, took  # the read timeout fired while nothing answered
    proxy.blackhole(0.2)  # the hole ends by itself at its time
    time.sleep(0.3)
    assert not proxy.blackholed and fs.cat(path) == b"w"


def test_bandwidth_cap_slows_transfers(proxy, s3_server):
    fs, path = _fs(proxy, s3_server, read_timeout_s=10.0), _path(s3_server)
    proxy.bandwidth(200_000)
    start = time.monotonic()
    fs.pipe(path, b"v" * SIZE)
    capped = time.monotonic() - start
    proxy.heal()
    start = time.monotonic()
    fs.pipe(path, b"v" * SIZE)
    free = time.monotonic() - start
    assert capped >= 1.2 and free < capped / 2, (capped, free)  # 300 kB at 200 kB/s: >= 1.5 s
