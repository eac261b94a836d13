"""Shared test fixtures: one local Ray instance per session, a local S3 server, storage backends.

Ray must bind to loopback only on these machines, so the environment is set before Ray is
imported anywhere in the test session.
"""

from __future__ import annotations

import gc
import os
import socket
import uuid

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
# Ray Train's controller polls its workers every 2 s by default, and a `ray.train.report` made
# within one poll of the previous one waits for the next poll (one result slot per worker; see
# bench/README.md). Tests report every few batches, so most of their Ray time was these waits.
# Polling faster changes when Ray looks, not what our code does; every Ray process of the session
# (the shared instance, the examples and Clusters the tests start) inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

import pytest
from hypothesis import HealthCheck, settings

# Property tests check results, not speed: a loaded CI machine must not fail them on Hypothesis's
# timing health checks ("input generation is slow") or per-example deadlines.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto in server mode) on 127.0.0.1; yields storage options for s3fs.

    The one definition every folder uses (the storage and checkpoint tests included). Two things make
    the fake behave like the service:

    * The bucket is created by a client without a region: with ``region_name="us-east-1"`` s3fs sends
      ``LocationConstraint=us-east-1``, which moto 5.2 rejects ("location-constraint is not valid", as
      real S3 does for us-east-1). The yielded options keep the region for the tests' clients.
    * moto's PutObject handler is serialized: moto checks ``If-None-Match: *`` and then stores the
      object as two steps on a threaded server, so two racing conditional PUTs could both succeed there
      (seen: 2 winners of 10 under load). Real S3 decides a conditional PUT atomically; the lock makes
      the fake match the service whose contract our create-only writes and locks rely on.
    """
    import logging
    import threading

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

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
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
    maker.mkdir("test-bucket")
    yield {"endpoint": endpoint, "bucket": "test-bucket", "storage_options": options}
    server.stop()
    patcher.undo()


@pytest.fixture(params=["file", "memory", "s3"])
def storage(request, tmp_path):
    """A fresh storage root on each backend: yields (url, storage_options)."""
    if request.param == "file":
        yield str(tmp_path / "store"), {}
    elif request.param == "memory":
        yield f"memory://store-{uuid.uuid4().hex}", {}
    else:
        srv = request.getfixturevalue("s3_server")
        yield f"s3://{srv['bucket']}/{uuid.uuid4().hex}", srv["storage_options"]


@pytest.fixture
def backend(storage) -> str:
    """The protocol name of the current ``storage`` parameter: file, memory or s3."""
    url, _ = storage
    return url.split("://", 1)[0] if "://" in url else "file"


@pytest.fixture(scope="session")
def ray_cluster(request):
    """One local Ray instance for the whole test session (CPU only, loopback only)."""
    import contextlib

    import ray

    audit = getattr(request.config, "_e2e_audit", None)  # the session's Ray is no test's own (tests/e2e.py)
    if not ray.is_initialized():
        with audit.excluded() if audit is not None else contextlib.nullcontext():
            # address="local": always a new instance of this session's own, never another Ray on the machine;
            # its state API too (`own_state_api`: else Train's cleaner may ask another instance and end a run)
            from raytrain_events.ray.embedded import own_state_api

            kwargs = dict(num_cpus=4, include_dashboard=False, log_to_driver=True)
            with own_state_api(kwargs):
                ray.init(address="local", **kwargs)
    yield ray
    ray.shutdown()


# Variables that libraries set on purpose in the test process and keep for its lifetime:
# Ray and Tune (driver settings, the session address), pytest's per-test marker, torch's and
# OpenMP's thread and device settings, Arrow/boto settings made by Ray Data or s3fs, and the
# settings tensorboard(X) makes on import (CRC32C_SW_MODE, TF_*, GRPC_*).
_ENV_ALLOWED_PREFIXES = (
    "RAY_",
    "_RAY",
    "TUNE_",
    "PYTEST_",
    "TORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA_",
    "ARROW_",
    "AWS_",
    "CRC32C_",
    "TF_",
    "GRPC_",
)


@pytest.fixture(autouse=True)
def no_leaked_environment_variables(request):
    """Fail a test that leaves ``os.environ`` changed (set, changed or removed), naming the variables.

    A test that needs a variable uses ``monkeypatch.setenv`` (undone after the test) or restores it.
    """
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(
        name
        for name in set(before) | set(after)
        if before.get(name) != after.get(name) and not name.startswith(_ENV_ALLOWED_PREFIXES)
    )
    if changed:
        details = ", ".join(f"{n}: {before.get(n, '<unset>')!r} -> {after.get(n, '<unset>')!r}" for n in changed)
        for name in changed:  # put them back, so the next test starts clean
            if name in before:
                os.environ[name] = before[name]
            else:
                os.environ.pop(name, None)
        pytest.fail(
            f"{request.node.nodeid} leaked environment variables ({details}); use monkeypatch.setenv or restore them.",
            pytrace=False,
        )


# ------------------------------------------------------------------ the garbage collector's heap
# Collecting the fast tier imports ~250 test modules with torch, Ray, transformers and friends: ~660,000
# objects that live for the whole session. Every full collection walked all of them (0.6-0.7 CPU-s each
# here), both Python's own and the loop's `gc.collect()` after an out-of-memory attempt (trainer/
# microbatching.py), so a test that retries a batch paid seconds for the session's imports. Freezing
# what exists after each collected module moves it out of the collector's generations (`gc.freeze`, the
# documented tool for long-lived start-up state): objects a test creates are collected as before.
def pytest_collectreport(report):
    gc.freeze()


def pytest_collection_finish(session):
    gc.collect()  # what collection left as garbage, once, before keeping the rest out of every later walk
    gc.freeze()


# ------------------------------------------------------------------ the end-to-end tier (tests/e2e.py)
import e2e  # noqa: E402  (tests/ is on sys.path: this conftest's folder)


def pytest_collection_modifyitems(config, items):
    e2e.mark_items(items)


def pytest_runtest_protocol(item, nextitem):
    audit = getattr(item.config, "_e2e_audit", None)
    if audit is not None:
        audit.current = item.nodeid


@pytest.fixture(scope="session", autouse=True)
def _e2e_audit_session(request):
    """With ``RTE_E2E_AUDIT`` set: watch which tests start a Ray run (see tests/e2e.py)."""
    if not os.environ.get("RTE_E2E_AUDIT"):
        yield None
        return
    audit = e2e.Audit()
    audit.start()
    request.config._e2e_audit = audit
    yield audit
    audit.stop()
    e2e.write_audit(audit, {i.nodeid for i in request.session.items if e2e.is_e2e(i)})


@pytest.fixture(autouse=True)
def _e2e_audit_test(request, _e2e_audit_session):
    """Fails a test that starts a Ray run without being listed in tests/e2e.py (audit mode only)."""
    yield
    if _e2e_audit_session is None:
        return
    _e2e_audit_session.poll()
    _e2e_audit_session.check_alive()
    started = _e2e_audit_session.started.get(request.node.nodeid)
    if started and not e2e.is_e2e(request.node):
        pytest.fail(
            f"{request.node.nodeid} started {', '.join(sorted(started))} but is not in the end-to-end list: "
            "add it to E2E in tests/e2e.py (or fold its check into an existing end-to-end run)",
            pytrace=False,
        )
