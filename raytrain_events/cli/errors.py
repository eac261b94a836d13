"""`UsageError`: bad input from the user (config, flags, storage URL); the CLI exits with code 2.

Commands raise it with a message that says what was wrong and what is accepted; `run_guarded`
prints ``error: <message>`` on stderr and returns the exit code instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["UsageError", "TrainingFailed", "run_guarded", "storage_step", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """The user's input cannot work (unknown key, bad duration, unreachable storage...): exit 2."""


class TrainingFailed(Exception):
    """Training started but failed (a worker raised): exit 1, with the worker's message."""


def run_guarded(fn: Callable[[], int | None], *, prog: str) -> int:
    """Call ``fn``; turn `UsageError` into exit 2 and `TrainingFailed` into exit 1 (message on stderr)."""
    try:
        code = fn()
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingFailed as exc:
        print(f"{prog}: training failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return EXIT_OK if code is None else code


def storage_step(url: str, fn: Callable[[], Any]) -> Any:
    """Run one storage operation of a job; any failure becomes a `UsageError` naming the URL, the cause and a fix."""
    try:
        return fn()
    except UsageError:
        raise
    except ImportError as exc:  # a missing fsspec backend names its extra
        raise UsageError(str(exc)) from None
    except Exception as exc:
        from raytrain_events.storage.errors import StorageError  # why here: storage/ imports fsspec

        if isinstance(exc, StorageError):  # already names the URL, the backend's error and a fix
            raise UsageError(f"Cannot use storage {url!r}: {exc}") from None
        raise UsageError(
            f"Cannot use storage {url!r}: {type(exc).__name__}: {exc}. Check the storage URL, that the bucket or "
            "folder exists and is writable, and storage_options (endpoint, credentials)."
        ) from None
