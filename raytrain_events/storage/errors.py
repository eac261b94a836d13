"""Exceptions raised by the storage layer.

Kept in one small module so callers can catch them without importing fsspec machinery,
and so every message follows the same rule: say what went wrong AND how to fix it.
"""

from __future__ import annotations


class StorageError(OSError):
    """A storage URL could not be reached or used (wraps the backend's own error).

    Subclasses ``OSError`` so code that already handles I/O errors keeps working.
    ``url`` names the location that failed; ``__cause__`` is the backend's exception.
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __str__(self) -> str:  # OSError.__str__ would mangle a single-argument message
        return str(self.args[0]) if self.args else ""


class WriteTimeoutError(StorageError, TimeoutError):
    """A write to an object store ran past its deadline and was cancelled (see ``fs.write_timeout_s``).

    A `StorageError` naming the URL, and a ``TimeoutError``, so checkpoint saves retry it.
    ``nbytes``: the size of the write; ``deadline_s``: the deadline it ran past."""

    def __init__(self, message: str, *, url: str | None = None, nbytes: int = 0, deadline_s: float = 0.0) -> None:
        super().__init__(message, url=url)
        self.nbytes, self.deadline_s = nbytes, deadline_s


class LockError(RuntimeError):
    """Base class for run-directory lock problems."""


class RunLockedError(LockError):
    """The lock is held by another live process (or a takeover lost a race)."""


class LockNotHeldError(LockError):
    """``release_lock`` was asked to remove a lock that this caller does not hold."""
