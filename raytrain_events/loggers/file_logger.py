"""`FileLogger`: metrics as JSON lines, one object per ``log_metrics`` call.

Each line is ``{"step": <global batch>, "<key>": <value>, ...}``; hyperparameters are written once
as ``{"hyperparameters": {...}}``. Lines are flushed as they are written, so a crash loses
nothing already logged and ``tail -f`` works. Non-scalar values become lists; other objects
their ``str``. The file is appended to by default, so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from raytrain_events.core.logger import LoggerDestination
from raytrain_events.core.plain import to_plain

__all__ = ["FileLogger"]


class FileLogger(LoggerDestination):
    """Write metrics to ``path`` as JSON lines.

    Example::

        Trainer(..., loggers=[FileLogger("runs/exp1/metrics.jsonl")])
        [json.loads(line) for line in open("runs/exp1/metrics.jsonl")]
    """

    def __init__(self, path: str, mode: str = "a") -> None:
        if mode not in ("a", "w"):
            raise ValueError(f"mode={mode!r} must be 'a' (append) or 'w' (overwrite).")
        self.path, self.mode = os.fspath(path), mode
        self._file = None

    def _open(self):
        if self._file is None:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            self._file = open(self.path, self.mode, encoding="utf-8")
        return self._file

    def _write(self, record: Dict[str, Any]) -> None:
        f = self._open()
        f.write(json.dumps(to_plain(record)) + "\n")
        f.flush()

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        self._write({"hyperparameters": hyperparameters})

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        self._write({"step": step, **metrics})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.mode = "a"  # a further fit appends to what this run wrote

    def __getstate__(self) -> Dict[str, Any]:  # picklable (e.g. shipped to a Ray worker) before use
        state = dict(self.__dict__)
        state["_file"] = None
        return state
