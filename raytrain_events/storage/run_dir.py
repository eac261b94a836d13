"""`RunDir`: the one owner of every name in a run directory (and of a sweep directory's few).

A run directory (``<storage>/<run name>`` on Ray, ``runs/<run name>`` for a plain `Trainer`)
holds, and only this module spells::

    config.yaml          the run's options (`RunDir.config`, written by the driver)
    summary.json         the driver's end-of-run summary (`RunDir.summary`, ``raytrain-events runs``)
    history.jsonl        every aggregated report, one JSON object per line (`RunDir.history`,
                         `read_history` / `append_history`: the format lives here, not in the
                         presentation package, so the runtime never imports ``report/``)
    report.html          the run report and its PNGs (`RunDir.report`)
    checkpoints/         committed checkpoints (`RunDir.checkpoints`), with
    checkpoints/index.json   the folder's index (`INDEX_FILE`, kept by `CheckpointFolder`)
    hangs/<group>/       stack dumps of a hung worker group (`RunDir.hangs`) and its hang.json
    preemptions/         one record per preemption notice (`RunDir.preemptions`)
    failures/            one record per failed worker group, as Ray Train's controller saw it
                         (`RunDir.failure`: the restarts of groups that failed before their first report)
    running, scheduled, ckpt   lock files (names in ``storage/locks.py``)

Inside each checkpoint directory the loop's state is ``state.pt`` (`STATE_FILE`). A sweep
directory holds ``sweep.json`` (`SWEEP_FILE`) and, in each trial folder, ``raytrain_trial.json``
(`TRIAL_RECORD`).

Code passes a `RunDir` (or a location it gives), never builds these names by hand:
``tests/test_ownership.py`` fails on a name literal anywhere else in the package.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

from raytrain_events.storage.fs import basename, join, read_bytes, resolve, to_url, write_bytes_atomic

__all__ = [
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FAILURES_DIR",
    "HANGS_DIR",
    "HANG_RECORD",
    "HISTORY_FILE",
    "INDEX_FILE",
    "PREEMPTIONS_DIR",
    "REPORT_FILE",
    "STATE_FILE",
    "SUMMARY_FILE",
    "SWEEP_FILE",
    "TRIAL_RECORD",
    "RunDir",
    "append_history",
    "checkpoints_url",
    "read_history",
]

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
HISTORY_FILE = "history.jsonl"
REPORT_FILE = "report.html"
CHECKPOINTS_DIR = "checkpoints"
INDEX_FILE = "index.json"  # in the checkpoints folder
HANGS_DIR = "hangs"
HANG_RECORD = "hang.json"  # in each hung group's folder, beside its rank dumps
PREEMPTIONS_DIR = "preemptions"
FAILURES_DIR = "failures"
STATE_FILE = "state.pt"  # in each checkpoint directory
SWEEP_FILE = "sweep.json"  # in a sweep directory: its metric and mode
TRIAL_RECORD = "raytrain_trial.json"  # in each trial folder of a sweep


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run directory: its URL plus the storage options needed to reach it.

    ``RunDir.of_checkpoints(folder)`` is the run a checkpoints folder belongs to: the parent of a
    ``<run>/checkpoints`` folder; any other folder (a `CheckpointConfig.save_folder` of the user's
    own) is its own run directory -- never some unrelated parent that other runs share.
    """

    url: str
    storage_options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_checkpoints(cls, folder: str, storage_options: Optional[Dict[str, Any]] = None) -> RunDir:
        """The run directory owning checkpoints folder ``folder`` (see the class docstring)."""
        stripped = folder.rstrip("/")
        if basename(stripped) == CHECKPOINTS_DIR and "/" in stripped:
            return cls(stripped.rsplit("/", 1)[0], dict(storage_options or {}))
        return cls(stripped, dict(storage_options or {}))

    def join(self, *parts: str) -> str:
        return join(self.url, *parts)

    @property
    def checkpoints(self) -> str:
        """URL of the run's checkpoints folder."""
        return self.join(CHECKPOINTS_DIR)

    def checkpoint(self, name: str) -> str:
        """URL of checkpoint directory ``name`` (``ckpt-<batch>-<id>``) of this run."""
        return self.join(CHECKPOINTS_DIR, name)

    @property
    def checkpoint_index(self) -> str:
        return self.join(CHECKPOINTS_DIR, INDEX_FILE)

    @property
    def config(self) -> str:
        return self.join(CONFIG_FILE)

    @property
    def summary(self) -> str:
        return self.join(SUMMARY_FILE)

    @property
    def history(self) -> str:
        return self.join(HISTORY_FILE)

    @property
    def report(self) -> str:
        return self.join(REPORT_FILE)

    def hangs(self, group_id: str) -> str:
        """Where a hung worker group ``group_id`` dumps its stacks."""
        return self.join(HANGS_DIR, group_id)

    def preemption(self, batch: int) -> str:
        """The record of a preemption notice handled at ``batch``."""
        return self.join(PREEMPTIONS_DIR, f"batch-{batch}.json")

    def failure(self, wall: float) -> str:
        """The record of a worker group's failure Ray Train's controller saw at ``wall`` (seconds since the epoch)."""
        return self.join(FAILURES_DIR, f"at-{int(wall * 1000)}.json")

    @property
    def failure_records(self) -> str:
        """A glob of every failure record (read by the run report's goodput)."""
        return self.join(FAILURES_DIR, "*.json")

    @property
    def hang_records(self) -> str:
        """A glob of every hung group's record (``hangs/*/hang.json``, read by the run report)."""
        return self.join(HANGS_DIR, "*", HANG_RECORD)

    @property
    def preemption_records(self) -> str:
        """A glob of every preemption record (read by the run report)."""
        return self.join(PREEMPTIONS_DIR, "*.json")

    def save_config(self, cfg: Any, *, resolve_interpolations: bool = False) -> str:
        """Write ``cfg`` (DictConfig, dict or dataclass) as YAML atomically; returns its URL."""
        from omegaconf import DictConfig, ListConfig, OmegaConf

        conf = cfg if isinstance(cfg, (DictConfig, ListConfig)) else OmegaConf.create(cfg)
        text = OmegaConf.to_yaml(conf, resolve=resolve_interpolations)
        fs, path = resolve(self.config, self.storage_options)
        write_bytes_atomic(fs, path, text.encode())
        return to_url(fs, path)

    def load_config(self) -> Any:
        """Read back the config written by ``save_config`` (a DictConfig)."""
        from omegaconf import OmegaConf

        fs, path = resolve(self.config, self.storage_options)
        try:
            data = read_bytes(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"No {CONFIG_FILE} in run directory {self.url!r}. Fix: call save_config() "
                "first, or point RunDir at the right run."
            ) from None
        return OmegaConf.create(data.decode())

    def read_history(self) -> List[Dict[str, Any]]:
        """The entries of ``history.jsonl`` (an empty list if the run saved none yet)."""
        fs, path = resolve(self.history, self.storage_options)
        if not fs.exists(path):
            return []
        text = read_bytes(fs, path).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def append_history(self, entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Save ``entries`` after the ones already there, their attempts numbered after the earlier
        ones' (a resumed run tells the whole story of the run directory); returns the whole history."""
        previous = self.read_history()
        offset = max((int(e.get("attempt", 0)) for e in previous), default=0)
        history = previous + [{**e, "attempt": int(e.get("attempt", 0)) + offset} for e in entries]
        fs, path = resolve(self.history, self.storage_options)
        body = "".join(json.dumps(e, sort_keys=True, default=str) + "\n" for e in history)
        write_bytes_atomic(fs, path, body.encode("utf-8"))
        return history


def checkpoints_url(run_url: str) -> str:
    """``<run>/checkpoints``: where a run's checkpoints go (same as ``RunDir(run_url).checkpoints``)."""
    return RunDir(run_url).checkpoints


def read_history(run_url: str, storage_options: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The entries saved in ``run_url``'s history file (`RunDir.read_history`)."""
    return RunDir(run_url, dict(storage_options or {})).read_history()


def append_history(
    run_url: str, entries: List[Dict[str, Any]], storage_options: Optional[Dict[str, Any]] = None
) -> List[Dict[str, Any]]:
    """Save ``entries`` after the ones already in ``run_url`` (`RunDir.append_history`)."""
    return RunDir(run_url, dict(storage_options or {})).append_history(entries)
