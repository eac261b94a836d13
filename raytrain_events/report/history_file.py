"""The run's history file, re-exported: its name and format belong to the run directory's owner
(``storage/run_dir.py``), so the runtime (``ray/driver.py`` writes it) never imports this package.

``<run dir>/history.jsonl`` holds every aggregated report of a `RayTrainer` run, one JSON object
per line; it is what ``raytrain-events report`` plots.
"""

from __future__ import annotations

from raytrain_events.storage.run_dir import HISTORY_FILE, append_history, read_history

__all__ = ["HISTORY_FILE", "read_history", "append_history"]
