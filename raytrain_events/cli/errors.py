"""`UsageError`: bad input from the user (config, flags, storage URL); the CLI exits with code 2.

Commands raise it with a message that says what was wrong and what is accepted; `run_guarded`
prints ``error: <message>`` on stderr and returns the exit code instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["UsageError", "TrainingFailed", "run_guarded", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]

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
