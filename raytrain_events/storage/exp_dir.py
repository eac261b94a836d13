"""Experiment (run) directories: their layout, picking a fresh ``run_N``, saving the run's config.

The layout has one owner, this module: ``config.yaml`` (``CONFIG_FILE``), ``summary.json``
(``SUMMARY_FILE``), ``checkpoints/`` (``CHECKPOINTS_DIR``, ``checkpoints_url``), the locks
(``storage/locks.py``'s lock names, files in the run directory) and ``history.jsonl``
(``report/history_file.HISTORY_FILE``).

``get_empty_exp_dir`` follows ml-starter: runs live in ``<root>/run_1``, ``<root>/run_2``...
The next run is ``run_{1 + max existing N}``. Unlike ml-starter it does not just return a
path: it *claims* the directory by create-only acquiring its ``scheduled`` lock, so two
launchers racing on the same root get different directories (the loser skips the locked
directory and tries the next N). Release the ``scheduled`` lock once the run has its
``running`` lock.

Usage::

    url = get_empty_exp_dir("s3://bucket/my-exp")          # e.g. s3://bucket/my-exp/run_4
    run = RunDir(url)
    run.save_config(cfg)
    assert run.load_config() == cfg

``check_run_name`` is the one rule for a run's name (``Trainer``, ``RayTrainer``, the CLI's
``run_name=``, a sweep's ``name``): one path segment, so a run never leaves its storage folder;
``fresh_run_name`` is the default name (unique per call, so two jobs never share a run directory
by accident).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import uuid
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from raytrain_events.storage.errors import RunLockedError
from raytrain_events.storage.fs import (
    basename,
    join,
    list_dir,
    read_bytes,
    resolve,
    to_url,
    write_bytes_atomic,
)
from raytrain_events.storage.locks import LockType, acquire_lock, has_lock

CONFIG_FILE = "config.yaml"
_RUN_RE = re.compile(r"^run_(\d+)$")


def check_run_name(name: Any, what: str = "run_name") -> str:
    """``name`` if it is one folder name inside the storage folder; else a ValueError naming the fix.

    Refused: anything but a non-empty string, ``.`` and ``..``, a ``/`` or ``\\`` (a path, or an
    absolute one), surrounding blanks, control characters and a ``://`` URL: each would put the
    run's files outside ``<storage_path>/<name>`` or in a folder other runs share.
    """
    problem = None
    if not isinstance(name, str):
        problem = f"is a {type(name).__name__}, not a string"
    elif not name.strip():
        problem = "is empty"
    elif name in (".", ".."):
        problem = "names the storage folder itself or its parent"
    elif "/" in name or "\\" in name:
        problem = "is a path (it has '/' or '\\'): the run would live outside its storage folder"
    elif name != name.strip() or any(ord(c) < 32 for c in name):
        problem = "has surrounding blanks or control characters"
    if problem is not None:
        raise ValueError(
            f"{what}={name!r} {problem}. Fix: give one folder name, like {what}='digits-lr0.1' (letters, digits, "
            "'-', '_', '.'); put the parent folder in storage_path."
        )
    return name


def fresh_run_name(prefix: str = "run") -> str:
    """A default run name, ``<prefix>-<date>-<time>-<6 hex>``: unique per call, so two jobs started in
    one directory (even in the same second) never share a run directory, its checkpoints or its lock."""
    return f"{prefix}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def get_empty_exp_dir(
    run_root_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    claim_with: LockType | None = "scheduled",
    max_attempts: int = 100,
) -> str:
    """Return the URL of a fresh ``run_N`` under ``run_root_url``.

    N is 1 + the largest existing N (directories holding any lock are skipped). With
    ``claim_with`` (default ``"scheduled"``) the directory is claimed by acquiring that
    lock create-only before it is returned; pass None to only compute the name (racy).
    """
    fs, root = resolve(run_root_url, storage_options)
    numbers = [
        int(m.group(1))
        for e in list_dir(fs, root)
        if e.get("type") == "directory" and (m := _RUN_RE.match(basename(e["name"])))
    ]
    n = max(numbers, default=0) + 1
    for _ in range(max_attempts):
        url = join(run_root_url, f"run_{n}")
        if has_lock(url, storage_options=storage_options):
            n += 1
            continue
        if claim_with is None:
            return url
        try:
            acquire_lock(url, claim_with, storage_options=storage_options)
            return url
        except RunLockedError:  # another launcher claimed run_n between our list and lock
            n += 1
    raise RunLockedError(
        f"Could not claim a free run_N directory under {run_root_url!r} after {max_attempts} "
        "attempts (all were locked by concurrent launchers). Fix: retry, or pass a larger "
        "max_attempts."
    )


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run directory: its URL plus the storage options needed to reach it."""

    url: str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def join(self, *parts: str) -> str:
        return join(self.url, *parts)

    @property
    def checkpoints(self) -> str:
        """URL of the run's checkpoints folder (``checkpoints_url``)."""
        return checkpoints_url(self.url)

    def save_config(self, cfg: Any, *, resolve_interpolations: bool = False) -> str:
        """Write ``cfg`` (DictConfig, dict or dataclass) as YAML atomically; returns its URL."""
        conf = cfg if isinstance(cfg, (DictConfig, ListConfig)) else OmegaConf.create(cfg)
        text = OmegaConf.to_yaml(conf, resolve=resolve_interpolations)
        fs, path = resolve(self.join(CONFIG_FILE), self.storage_options)
        write_bytes_atomic(fs, path, text.encode())
        return to_url(fs, path)

    def load_config(self) -> DictConfig | ListConfig:
        """Read back the config written by ``save_config``."""
        fs, path = resolve(self.join(CONFIG_FILE), self.storage_options)
        try:
            data = read_bytes(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"No {CONFIG_FILE} in run directory {self.url!r}. Fix: call save_config() "
                "first, or point RunDir at the right run."
            ) from None
        return OmegaConf.create(data.decode())


# -- the run directory's layout: every module asks here for these names ---------------------------
#: Committed checkpoints (and their ``index.json``) live in this folder of the run directory.
CHECKPOINTS_DIR = "checkpoints"
#: The driver's end-of-run summary (``raytrain-events runs``).
SUMMARY_FILE = "summary.json"


def checkpoints_url(run_url: str) -> str:
    """``<run>/checkpoints``: where a run's checkpoints go (the one place that builds this path)."""
    return join(run_url, CHECKPOINTS_DIR)


def run_url_of_checkpoints(folder: str) -> str:
    """The run directory holding a checkpoints folder (its parent; itself if it has none)."""
    stripped = folder.rstrip("/")
    return stripped.rsplit("/", 1)[0] if "/" in stripped else stripped
