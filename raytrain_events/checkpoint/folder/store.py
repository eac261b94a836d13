"""A directory of checkpoints: list, pick the latest, prune, load with fallback, save async.

Only committed checkpoints (directories holding ``manifest.json``, see ``format.py``) exist
for these functions; a directory left behind by a crashed save is invisible until
``prune_checkpoints`` deletes it. "Latest" and pruning go through the folder's
`CheckpointIndex` (``index.py``: one LIST and one GET, not a manifest read per checkpoint);
``list_checkpoints`` reads every manifest (it returns them). Deleting is `CheckpointFolder`'s
(``folder.py``); ``prune_checkpoints`` asks it. Order is oldest -> newest by the manifest's
``timestamp["batch"]``, then creation time, then name.

``AsyncCheckpointWriter`` runs saves on one background thread, started lazily on first
``submit`` (never at import), with at most one save in flight: a new ``submit`` first waits
for the previous save. An exception from a background save is re-raised by the next
``submit``/``wait``/``close``; it is never swallowed.

Usage::

    writer = AsyncCheckpointWriter()
    writer.submit(lambda: (write_checkpoint(root, files=..., timestamp=..., world_size=1),
                           prune_checkpoints(root, keep=3)))
    ...
    writer.close()
    loaded = load_latest_valid(root)   # None when there is nothing loadable
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from raytrain_events.checkpoint.folder.folder import CheckpointFolder
from raytrain_events.checkpoint.folder.folder import delete_checkpoint as delete_checkpoint  # re-exported
from raytrain_events.checkpoint.folder.index import CheckpointIndex
from raytrain_events.checkpoint.folder.local_tier import LocalTier
from raytrain_events.checkpoint.format.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointNotCommittedError,
    LoadedCheckpoint,
)
from raytrain_events.checkpoint.format.packed import HEAD_BYTES, needs_whole
from raytrain_events.checkpoint.format.reader import read_checkpoint, read_checkpoint_files, read_manifest
from raytrain_events.storage.fs import join, list_dir, read_many, resolve, to_url

logger = logging.getLogger(__name__)


def list_checkpoints(root_url: str, *, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root_url``, oldest first ([] if the root does not exist).

    Directories with an unreadable manifest are skipped with a warning; a manifest of a newer
    format version raises UnsupportedCheckpointVersionError (upgrade rather than ignore it).
    """
    committed, _ = _scan(root_url, storage_options)
    return committed


def latest_checkpoint(root_url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint, or None: the index (one LIST, one GET) and its manifest."""
    index = CheckpointIndex.load(root_url, storage_options)
    for entry in index.newest_first():
        if entry.name in index.infos:
            return index.infos[entry.name]
        try:
            return read_manifest(index.url(entry), storage_options=storage_options)
        except (CheckpointCorruptError, CheckpointNotCommittedError) as e:  # deleted or garbled since
            logger.warning("Skipping checkpoint %s: %s", entry.name, e)
    return None


def prune_checkpoints(root_url: str, *, keep: int, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Delete all but the newest ``keep`` committed checkpoints; returns the deleted URLs.

    Also deletes uncommitted ``ckpt-<batch>-<id>`` directories whose batch is below the
    newest committed one (leftovers of crashed saves; a save still in flight is for a newer
    batch and is left alone). Call it only after a new checkpoint has been committed. A
    process that commits repeatedly keeps a `CheckpointFolder` and calls its ``prune`` instead
    (no listing per commit).
    """
    if keep < 1:
        raise ValueError(f"prune_checkpoints(keep={keep}) would delete every checkpoint. Fix: pass keep >= 1.")
    return CheckpointFolder(root_url, storage_options).prune(keep)


def load_latest_valid(
    root_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    files: Iterable[str] | None = None,
    map_location: Any = "cpu",
    index: CheckpointIndex | None = None,
    local_tier: LocalTier | None = None,
) -> LoadedCheckpoint | None:
    """Load the newest checkpoint that verifies, skipping (with a warning) corrupt ones.

    ``index``: the folder's `CheckpointIndex` if the caller holds one (else it is loaded).
    ``local_tier``: the node-local copies to read files from where they match (``local_tier.py``).

    Unsafe (non-allowlisted pickle) and unsupported-version checkpoints are raised, not
    skipped: both need a human decision, and silently resuming from an older checkpoint
    would hide them.
    """
    names = None if files is None else list(files)
    index = index or CheckpointIndex.load(root_url, storage_options)
    for entry in index.newest_first():
        url, info = index.url(entry), index.infos.get(entry.name)
        local = local_tier.copies(entry.name) if local_tier is not None else None
        try:
            if info is not None:  # reconciling the index read its manifest already: not again
                return read_checkpoint_files(
                    info, storage_options=storage_options, files=names, map_location=map_location, local=local
                )
            return read_checkpoint(
                url, storage_options=storage_options, files=names, map_location=map_location, local=local
            )
        except (CheckpointCorruptError, CheckpointNotCommittedError) as e:
            logger.warning("Skipping checkpoint %s: %s", url, e)
    return None


def _scan(root_url: str, storage_options: dict[str, Any] | None) -> tuple[list[CheckpointInfo], list[str]]:
    """(committed infos sorted oldest first, URLs of directories without a manifest)."""
    fs, root = resolve(root_url, storage_options)
    dirs = [e["name"] for e in list_dir(fs, root) if e.get("type") == "directory"]
    manifests = [join(d, MANIFEST) for d in dirs]
    # one ranged GET each, concurrent: a packed manifest.json holds its payload too (packed.py)
    raw = read_many(fs, manifests, end=HEAD_BYTES)
    longer = [m for m, data in raw.items() if needs_whole(data)]
    raw.update(read_many(fs, longer))  # rare: a manifest longer than that
    committed: list[CheckpointInfo] = []
    uncommitted: list[str] = []
    for d, m in zip(dirs, manifests):
        data = raw.get(m)
        if data is None:
            uncommitted.append(to_url(fs, d))
            continue
        try:
            committed.append(CheckpointInfo.from_manifest(to_url(fs, d), data))
        except CheckpointCorruptError as e:  # unsupported versions propagate: see load_latest_valid
            logger.warning("Ignoring checkpoint %s: %s", to_url(fs, d), e)
    committed.sort(key=lambda c: (c.batch, c.created, c.name))
    return committed, uncommitted


class AsyncCheckpointWriter:
    """Run save functions on one background thread, at most one in flight."""

    def __init__(self, *, thread_name: str = "raytrain-ckpt-writer", keep_going: bool = False) -> None:
        """``keep_going``: a failed save is not re-raised by ``submit``/``wait``/``close`` (its
        caller reported it, and its future still raises to whoever waits on that save)."""
        self._thread_name = thread_name
        self._keep_going = keep_going
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Wait for the previous save, then start ``fn`` in the background.

        If the previous save failed, its exception is raised here and ``fn`` is NOT started.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCheckpointWriter is closed. Fix: create a new writer.")
            self._wait_locked()
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._thread_name
                )
            self._pending = self._executor.submit(fn)
            return self._pending

    def wait(self) -> Any:
        """Block until the in-flight save finishes; re-raise its exception; return its result."""
        with self._lock:
            return self._wait_locked()

    @property
    def busy(self) -> bool:
        pending = self._pending
        return pending is not None and not pending.done()

    def close(self) -> None:
        """Wait for the in-flight save (re-raising its error) and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._wait_locked()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None

    def _wait_locked(self) -> Any:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if self._keep_going and pending.exception() is not None:
            return None
        return pending.result()  # raises the save's exception

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already unwinding: don't let a save error mask the original one
            self.close()
        except Exception:
            logger.exception("Background checkpoint save failed while handling another error")


def cpu_copy(tree: Any) -> Any:
    """A deep copy of ``tree`` with every tensor cloned to CPU (detached from training)."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cpu_copy(v) for v in tree)
    return tree


class DoneFuture:
    """A finished future for synchronous saves."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._value

    def done(self) -> bool:
        return True
