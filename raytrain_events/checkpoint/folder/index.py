"""`CheckpointIndex`: which checkpoints of a folder are committed, kept so that a commit costs O(1).

Without it every commit listed the folder and read every manifest (one LIST plus one GET per
checkpoint) to prune and to find "latest", so a run's commits grew with its history. Now:

* The committing process (rank 0) loads the index once, at start-up: one GET of
  ``<folder>/index.json``, one LIST of the folder (names only), and a manifest read only for
  directories the index does not name. That reconciliation is what makes the index safe to be
  stale: a crash between a commit and the index update, an index deleted or garbled, or
  checkpoints deleted by someone else (Ray's pruning) cost at most a few GETs at the next start,
  never a lost or phantom checkpoint.
* A commit then adds its entry in memory and rewrites ``index.json`` atomically (one PUT); it
  never lists or reads older checkpoints. A failed index write is logged and ignored: the
  commit itself (the manifest) is what counts, and the next start reconciles.
* Saves that failed for good are listed too (``failed``: name, batch, error, time), so the run
  report can show them; they are written with the next index update (a commit, or the run's
  end) -- not at the failure, when the store is likely still down.
* Retention and every deletion belong to `CheckpointFolder` (``folder.py``), which holds the
  index and tells it what it deleted (`forget`); the index itself deletes nothing.

Only the run's `CheckpointFolder` writes the index (the run directory's ``running`` lock makes it one
process); readers (`latest_checkpoint`, the CLI) load it the same way and never write it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from raytrain_events.checkpoint.format.manifest import (
    CHECKPOINT_NAME_RE,
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
)
from raytrain_events.checkpoint.format.packed import HEAD_BYTES, needs_whole
from raytrain_events.storage.fs import (
    basename,
    join,
    list_dir,
    read_bytes,
    read_many,
    resolve,
    to_url,
    write_bytes_atomic,
)
from raytrain_events.storage.run_dir import INDEX_FILE

__all__ = ["INDEX_FILE", "CheckpointIndex", "IndexEntry", "batch_of_name"]
_INDEX_VERSION = 1
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexEntry:
    """One committed checkpoint: its directory name and what orders it (oldest -> newest)."""

    name: str
    batch: int
    created: float

    @property
    def key(self) -> tuple:
        return (self.batch, self.created, self.name)


class CheckpointIndex:
    """The committed checkpoints of one folder, oldest first, and leftovers of crashed saves."""

    def __init__(self, root_url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root_url = root_url
        self.options = dict(storage_options or {})
        self.entries: list[IndexEntry] = []
        self.leftovers: list[str] = []  # URLs of uncommitted directories seen at load
        self.dead_writes: list[str] = []  # URLs of index temp files seen at load: their writers died mid-write
        self.infos: dict[str, CheckpointInfo] = {}  # manifests read while reconciling (not read again)
        self.failed: list[dict[str, Any]] = []  # saves that failed for good: name, batch, error, time
        self.unsaved = False  # `failed` changed since the last write

    @classmethod
    def load(cls, root_url: str, storage_options: dict[str, Any] | None = None) -> CheckpointIndex:
        """Read ``index.json`` and reconcile it with one LIST (see the module docstring)."""
        index = cls(root_url, storage_options)
        fs, root = resolve(root_url, index.options)
        indexed = index._read_file(fs, root)
        listing = list_dir(fs, root)
        dirs = {basename(e["name"]): e["name"] for e in listing if e.get("type") == "directory"}
        # A local index write is a temp file renamed onto index.json (`write_bytes_atomic`); one killed before the
        # rename (a SIGKILLed rank 0) leaves its temp behind. Only the committing process writes the index, so
        # at its load any such temp is a dead writer's: `CheckpointFolder` deletes it with the crashed saves.
        index.dead_writes = [
            to_url(fs, e["name"]) for e in listing if e.get("type") == "file" and is_index_temp(basename(e["name"]))
        ]
        entries = [e for name, e in indexed.items() if name in dirs]  # gone ones (pruned by Ray) drop out
        unknown = [path for name, path in dirs.items() if name not in indexed]
        manifests = [join(p, MANIFEST) for p in unknown]
        raw = read_many(fs, manifests, end=HEAD_BYTES)
        raw.update(read_many(fs, [m for m, data in raw.items() if needs_whole(data)]))
        for path, manifest in zip(unknown, manifests):
            data = raw.get(manifest)
            if data is None:
                index.leftovers.append(to_url(fs, path))
                continue
            try:
                info = CheckpointInfo.from_manifest(to_url(fs, path), data)
            except CheckpointCorruptError as e:  # unsupported versions propagate (a human decides)
                _log.warning("Ignoring checkpoint %s: %s", to_url(fs, path), e)
                continue
            entries.append(IndexEntry(info.name, info.batch, info.created))
            index.infos[info.name] = info
        index.entries = sorted(entries, key=lambda e: e.key)
        return index

    def _read_file(self, fs: Any, root: str) -> dict[str, IndexEntry]:
        try:
            data = json.loads(read_bytes(fs, join(root, INDEX_FILE), single_get=True))
            if data.get("version") != _INDEX_VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            self.failed = [dict(f) for f in data.get("failed", [])]
            return {
                e["name"]: IndexEntry(str(e["name"]), int(e["batch"]), float(e["created"])) for e in data["entries"]
            }
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # rebuilt from the folder below
            _log.warning("Rebuilding the checkpoint index of %s from its folder (unreadable: %s)", self.root_url, e)
            return {}

    def url(self, entry: IndexEntry) -> str:
        fs, root = resolve(self.root_url, self.options)
        return to_url(fs, join(root, entry.name))

    def newest(self) -> IndexEntry | None:
        return self.entries[-1] if self.entries else None

    def newest_first(self) -> list[IndexEntry]:
        return list(reversed(self.entries))

    def add(self, info: CheckpointInfo) -> None:
        """Record a checkpoint just committed and rewrite ``index.json`` (one PUT, no listing)."""
        entry = IndexEntry(info.name, info.batch, info.created)
        self.entries = sorted([e for e in self.entries if e.name != entry.name] + [entry], key=lambda e: e.key)
        self.save()

    def add_failure(self, url: str, batch: int | None, error: str, when: float) -> None:
        """Record a save that failed for good (written with the next `save`)."""
        self.failed.append({"name": basename(url), "batch": batch, "error": error, "time": when})
        self.unsaved = True

    def save(self) -> None:
        """Write ``index.json`` atomically; a failure is logged (the next load rebuilds it)."""
        body = {"version": _INDEX_VERSION, "entries": [e.__dict__ for e in self.entries], "failed": self.failed}
        try:
            fs, root = resolve(self.root_url, self.options)
            write_bytes_atomic(fs, join(root, INDEX_FILE), json.dumps(body, separators=(",", ":")).encode())
            self.unsaved = False
        except Exception as e:  # the manifest committed the checkpoint; the index is a cache of the folder
            _log.warning(
                "Could not update the checkpoint index of %s (rebuilt at the next start): %s", self.root_url, e
            )

    def forget(self, names: list[str], *, save: bool = True) -> None:
        """Drop entries whose checkpoints were deleted (by `CheckpointFolder`); rewrite the file."""
        if not names:
            return
        self.entries = [e for e in self.entries if e.name not in names]
        if save:
            self.save()

    def take_dead_writes(self) -> list[str]:
        """The temp files of index writes whose writers died (seen at load), no longer tracked: the caller deletes
        them."""
        dead, self.dead_writes = self.dead_writes, []
        return dead

    def take_leftovers_below(self, batch: int) -> list[str]:
        """The leftovers (crashed saves) of batches below ``batch``, no longer tracked: the caller deletes them."""
        stale = [u for u in self.leftovers if batch_of_name(basename(u)) < batch]
        self.leftovers = [u for u in self.leftovers if u not in stale]
        return stale


def is_index_temp(name: str) -> bool:
    """Whether ``name`` is the temp file of a local ``index.json`` write (`write_bytes_atomic`: ``.index.json.*.tmp``)."""
    return name.startswith(f".{INDEX_FILE}.") and name.endswith(".tmp")


def batch_of_name(name: str, *, unknown: int = 1 << 62) -> int:
    """The batch a checkpoint directory name (``ckpt-<batch>-<id>``) holds; ``unknown`` if not one of ours
    (by default larger than any batch: a directory that is not ours is never below one)."""
    m = CHECKPOINT_NAME_RE.match(name)
    return int(m.group(1)) if m else unknown
