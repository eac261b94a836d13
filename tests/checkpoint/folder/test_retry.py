"""`is_transient`: which storage errors a save retries (the store's "slow down" among them)."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError

from raytrain_events.checkpoint.folder.retry import is_transient
from raytrain_events.storage.errors import StorageError


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Put"
    )


def _as_s3fs_raises(cause: ClientError, err: int) -> StorageError:
    """What the storage layer raises: StorageError <- OSError (s3fs's translation) <- ClientError."""
    translated = OSError(err, str(cause))
    translated.__cause__ = cause
    wrapped = StorageError("Storage failed while creating", url="s3://b/k")
    wrapped.__cause__ = translated
    return wrapped


@pytest.mark.parametrize(
    "code,status,err",
    [("SlowDown", 503, errno.EBUSY), ("InternalError", 500, errno.EIO), ("ServiceUnavailable", 503, errno.EIO)],
)
def test_the_stores_try_again_answers_are_transient(code, status, err):
    assert is_transient(_as_s3fs_raises(_client_error(code, status), err))
    assert is_transient(_client_error(code, status))


@pytest.mark.parametrize("code,status", [("AccessDenied", 403), ("InvalidRequest", 400)])
def test_client_errors_a_retry_cannot_fix_are_not(code, status):
    assert not is_transient(_as_s3fs_raises(_client_error(code, status), errno.EIO))
    assert not is_transient(PermissionError("denied"))
