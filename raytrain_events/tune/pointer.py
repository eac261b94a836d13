"""Checkpoint pointers: what a Tune trial reports to Tune instead of copying its checkpoint.

Our checkpoints are already committed in the trial's run dir (object storage or a shared
folder). Tune persists every checkpoint a trial reports, so a trial reports a tiny directory
holding only ``raytrain_pointer.json``: the committed checkpoint's URL, its global Timestamp
counters, and the trial folder, run, algorithm set and mixture (the searched weights and the run's whole `Mixture`, with
its switch stages) that saved it. A scheduler that restores a
trial from it (PBT's exploit, a resumed sweep) hands the pointer back through
``ray.tune.get_checkpoint()``; the trial reads it with `read_pointer` and loads the real checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from raytrain_events.core.plain import to_plain
from raytrain_events.core.timestamp import COUNTER_UNITS, report_key
from raytrain_events.storage.run_dir import RunDir

__all__ = ["CheckpointPointer", "POINTER_FILE", "pointer_from_entry", "write_pointer", "read_pointer"]

POINTER_FILE = "raytrain_pointer.json"


@dataclass(frozen=True)
class CheckpointPointer:
    """Where a trial's committed checkpoint lives and when (in global counters) it was saved."""

    url: str  # the committed checkpoint directory (with its manifest.json)
    counters: Dict[str, int]  # {"epoch", "batch", "sample", "token"} of the report that saved it
    trial_folder: str  # the Tune trial folder whose run saved it
    run_name: str  # the run (inside the trial folder) that saved it
    algorithms: List[Any] = field(default_factory=list)  # the saving trial's algorithm set
    mixture: Optional[Dict[str, float]] = None  # the saving trial's searched mixture weights (config["mixture"])
    run_mixture: Optional[Dict[str, Any]] = None  # the saving run's whole mixture (Mixture.to_dict(), with switches)

    @property
    def name(self) -> str:
        """The checkpoint directory's name (``ckpt-<batch>-<id>``)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]


def pointer_from_entry(  # noqa: PLR0913 (the entry, then who saved it: run, trial, run name, set, mixture)
    entry: Mapping[str, Any],
    run_url: str,
    trial_folder: str,
    run_name: str,
    algorithms: List[Any],
    mixture: Optional[Mapping[str, float]] = None,
    run_mixture: Optional[Mapping[str, Any]] = None,
) -> Optional[CheckpointPointer]:
    """The pointer for the checkpoint a history entry names (None if it names none).

    The entry's ``checkpoint_path`` is Ray's path of the directory (no scheme); the URL is
    rebuilt from the run's URL so that it keeps the scheme (``s3://...``).
    """
    path = entry.get("checkpoint_path")
    if not path:
        return None

    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    counters = {unit: int(entry.get(report_key(unit), 0) or 0) for unit in COUNTER_UNITS}
    return CheckpointPointer(
        url=RunDir(run_url.rstrip("/")).checkpoint(name),
        counters=counters,
        trial_folder=trial_folder,
        run_name=run_name,
        algorithms=list(algorithms),
        mixture=None if mixture is None else dict(mixture),
        run_mixture=None if run_mixture is None else dict(run_mixture),
    )


def write_pointer(folder: str, pointer: CheckpointPointer) -> str:
    """Write ``pointer`` as ``<folder>/raytrain_pointer.json``; returns the file's path."""

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, POINTER_FILE)
    with open(path, "w") as f:
        json.dump(to_plain(asdict(pointer), fallback=repr), f, indent=1)
    return path


def read_pointer(folder: str) -> CheckpointPointer:
    """The pointer in a checkpoint directory Tune handed back; a clear error if it holds none."""
    path = os.path.join(folder, POINTER_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"The Tune checkpoint {folder} has no {POINTER_FILE}: it was not reported by a raytrain_events "
            "sweep trial. Restore sweeps only from checkpoints their own trials reported."
        ) from None
    missing = {"url", "counters", "trial_folder", "run_name"} - set(data)
    if missing:
        raise ValueError(f"{path} lacks {', '.join(sorted(missing))}: it is torn or not a raytrain_events pointer.")
    return CheckpointPointer(
        url=data["url"],
        counters={k: int(v) for k, v in data["counters"].items()},
        trial_folder=data["trial_folder"],
        run_name=data["run_name"],
        algorithms=list(data.get("algorithms") or []),
        mixture=data.get("mixture"),
        run_mixture=data.get("run_mixture"),
    )
