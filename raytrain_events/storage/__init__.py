"""Storage layer: fsspec URLs, atomic and create-only writes, run locks, run dirs, config diffs.

Imports fsspec and omegaconf only (no torch, no Ray), so it is cheap to import on the driver.
Checkpoint files built on top of it live in ``raytrain_events.checkpoint``.

Files:

* ``_compat.py``: Every private fsspec and s3fs name this package uses, in one place (probed by
  ``check_private_names``).
* ``config_diff.py``: Line-oriented differences between two configs (e.g.
* ``crc32.py``: CRC32 (zlib's CRC-32, the one zip, gzip and S3's ``ChecksumCRC32`` use) for
  checkpoint files.
* ``errors.py``: Exceptions raised by the storage layer.
* ``exp_dir.py``: Experiment (run) directories: their layout, picking a fresh ``run_N``, saving the
  run's config.
* ``fs.py``: URL -> filesystem resolution and the few byte-level primitives the rest of storage
  uses.
* ``location.py``: `Location`: a URL resolved once into its filesystem and path, then passed down
  instead of the URL.
* ``locks.py``: Run-directory lock files (``running``, ``scheduled``, ``ckpt``), in ml-starter's
  style.
* ``objectstore/``: Object-store transfers for large immutable files: uploads fed while the bytes
  are produced, CRC32ed once, in parallel parts; downloads in parallel ranges, verified while they
  arrive.
* ``run_dir.py``: `RunDir`: the one owner of every name in a run directory (and of a sweep
  directory's few).
"""

from raytrain_events.storage.config_diff import diff_configs, format_config_diff
from raytrain_events.storage.errors import LockError, LockNotHeldError, RunLockedError, StorageError, WriteTimeoutError
from raytrain_events.storage.exp_dir import RunDir, get_empty_exp_dir
from raytrain_events.storage.fs import (
    join,
    read_bytes,
    resolve,
    write_bytes_atomic,
    write_bytes_create_only,
)
from raytrain_events.storage.locks import (
    LOCK_TYPES,
    LockInfo,
    LockType,
    acquire_lock,
    has_lock,
    read_lock,
    refresh_lock,
    release_lock,
)

__all__ = [
    "LOCK_TYPES",
    "LockError",
    "LockInfo",
    "LockNotHeldError",
    "LockType",
    "RunDir",
    "RunLockedError",
    "StorageError",
    "WriteTimeoutError",
    "acquire_lock",
    "diff_configs",
    "format_config_diff",
    "get_empty_exp_dir",
    "has_lock",
    "join",
    "read_bytes",
    "read_lock",
    "refresh_lock",
    "release_lock",
    "resolve",
    "write_bytes_atomic",
    "write_bytes_create_only",
]
