"""Experiment (run) directories: their layout, picking a fresh ``run_N``, saving the run's config.

The layout of a run directory (every file and folder name in it) has one owner,
``storage/run_dir.py`` (`RunDir`, re-exported here); the lock names are ``storage/locks.py``'s.

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

import datetime
import re
import uuid
from typing import Any

from raytrain_events.storage.errors import RunLockedError
from raytrain_events.storage.fs import basename, join, list_dir, resolve
from raytrain_events.storage.locks import LockType, acquire_lock, has_lock
from raytrain_events.storage.run_dir import (  # re-exported: the run directory's layout lives there
    CHECKPOINTS_DIR as CHECKPOINTS_DIR,
)
from raytrain_events.storage.run_dir import CONFIG_FILE as CONFIG_FILE
from raytrain_events.storage.run_dir import SUMMARY_FILE as SUMMARY_FILE
from raytrain_events.storage.run_dir import RunDir as RunDir
from raytrain_events.storage.run_dir import checkpoints_url as checkpoints_url

_RUN_RE = re.compile(r"^run_(\d+)$")


NAME_MAX = 255  # bytes in one folder name on Linux and macOS (and a sane key part on object stores)


def check_run_name(name: Any, what: str = "run_name") -> str:
    """``name`` if it is one folder name inside the storage folder; else a ValueError naming the fix.

    Refused: anything but a non-empty string, ``.`` and ``..``, a ``/`` or ``\\`` (a path, or an
    absolute one), surrounding blanks, control characters, a ``://`` URL and more than `NAME_MAX`
    bytes (no file system holds it): each would put the
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
    elif len(name.encode()) > NAME_MAX:
        problem = f"is {len(name.encode())} bytes long: a folder name holds at most {NAME_MAX} (put details in config=)"
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


def run_url_of_checkpoints(folder: str) -> str:
    """The run directory owning a checkpoints folder (`RunDir.of_checkpoints`: the parent of a
    ``<run>/checkpoints`` folder, else the folder itself)."""
    return RunDir.of_checkpoints(folder).url
