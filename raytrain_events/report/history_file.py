"""The run's history file: every aggregated report of a `RayTrainer` run, one JSON object per line.

``<run dir>/history.jsonl`` is written by the driver when a run ends (finished or failed) and is
what ``raytrain-events report`` plots. A resumed run (same run directory, a new ``fit``) appends
its entries after the earlier ones, its attempts numbered after theirs, so the file tells the
whole story of the run directory.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

__all__ = ["HISTORY_FILE", "read_history", "append_history"]

HISTORY_FILE = "history.jsonl"


def read_history(run_url: str, storage_options: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The entries saved in ``run_url`` (an empty list if the run saved none yet)."""
    from raytrain_events.storage.fs import join, read_bytes, resolve

    fs, path = resolve(join(run_url, HISTORY_FILE), storage_options or {})
    if not fs.exists(path):
        return []
    text = read_bytes(fs, path).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_history(
    run_url: str, entries: List[Dict[str, Any]], storage_options: Optional[Dict[str, Any]] = None
) -> List[Dict[str, Any]]:
    """Save ``entries`` after the ones already in ``run_url``; returns the whole history."""
    from raytrain_events.storage.fs import join, resolve, write_bytes_atomic

    previous = read_history(run_url, storage_options)
    offset = max((int(e.get("attempt", 0)) for e in previous), default=0)
    new = [{**e, "attempt": int(e.get("attempt", 0)) + offset} for e in entries]
    history = previous + new
    fs, path = resolve(join(run_url, HISTORY_FILE), storage_options or {})
    body = "".join(json.dumps(e, sort_keys=True, default=str) + "\n" for e in history)
    write_bytes_atomic(fs, path, body.encode("utf-8"))
    return history
