"""Storage-suite fixtures. The S3 server (``s3_server``) and the storage backends (``storage``, ``backend``)
are the shared ones of ``tests/conftest.py``, which the checkpoint tests use too."""

from __future__ import annotations

import pytest


@pytest.fixture
def fast_thread_switching():
    """Switch threads every microsecond so check-then-write races actually interleave."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)
