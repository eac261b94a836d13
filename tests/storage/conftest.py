"""Storage-suite fixtures.

``s3_server`` overrides the shared one in ``tests/conftest.py`` for this folder only: that one
creates its bucket with ``region_name="us-east-1"`` in the client options, which makes s3fs
send ``LocationConstraint=us-east-1`` and moto 5.2 rejects it ("location-constraint is not
valid", as real S3 does for us-east-1). Here the bucket is created by a client without a
region; the yielded dict has the same shape, so the shared ``storage`` fixture works unchanged.

It also serializes moto's PutObject handler: moto checks ``If-None-Match: *`` and then stores
the object as two steps on a threaded server, so two racing conditional PUTs can both succeed
there (seen here: 2 winners of 10 under load). Real S3 decides a conditional PUT atomically;
the lock makes the fake match the service whose contract our create-only locks rely on.

The bucket has its own name: moto keeps its buckets in process-wide state, so when this folder
and another one (``tests/checkpoint``, which uses the shared fixture) run in one session, the
second server would otherwise fail to create the already existing ``test-bucket``.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    import s3fs
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    serialize = threading.Lock()
    unpatched_put = S3Response.put_object

    def atomic_put_object(self):
        with serialize:
            return unpatched_put(self)

    patcher = pytest.MonkeyPatch()
    patcher.setattr(S3Response, "put_object", atomic_put_object)

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    maker = s3fs.S3FileSystem(
        key="testing", secret="testing", skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint}
    )
    maker.mkdir("storage-test-bucket")
    yield {"endpoint": endpoint, "bucket": "storage-test-bucket", "storage_options": options}
    server.stop()
    patcher.undo()


@pytest.fixture
def backend(storage) -> str:
    """The protocol name of the current ``storage`` parameter: file, memory or s3."""
    url, _ = storage
    return url.split("://", 1)[0] if "://" in url else "file"


@pytest.fixture
def fast_thread_switching():
    """Switch threads every microsecond so check-then-write races actually interleave."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)
