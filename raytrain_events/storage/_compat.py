"""Every private fsspec and s3fs name this package uses, in one place (the storage counterpart of
``ray/_compat.py`` and ``_torch_compat.py``).

fsspec and s3fs may rename a private name in any release. Each one is reached here through a
small function with a public name; `check_private_names()` probes them all, and
``tests/storage/test_storage_compat.py`` runs it and fails on a use anywhere else in the package,
so an upgrade that removes one fails one test loudly instead of a checkpoint upload.

Private names used (checked against fsspec 2026.9.0 and s3fs 2026.9.0):

* fsspec ``AbstractFileSystem._strip_protocol``: a path as the filesystem keys it (how ``fs.cat``
  names its results, and ``memory://``'s store key), `strip_protocol`.
* s3fs ``S3FileSystem._call_s3``: one S3 API call through s3fs's own retrying, credentialed client
  (multipart uploads with per-part checksums, versioned ranged GETs), `call_s3`.
* s3fs ``S3FileSystem._pipe_file``: one PUT with extra S3 arguments (``ChecksumCRC32``) and, in
  newer s3fs, ``mode="create"`` (a conditional PUT), `pipe_file` / `pipe_file_method`.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Tuple

__all__ = ["NAMES", "call_s3", "check_private_names", "pipe_file", "pipe_file_method", "strip_protocol"]

#: public name here -> (module, class, private attribute)
NAMES: Dict[str, Tuple[str, str, str]] = {
    "strip_protocol": ("fsspec.spec", "AbstractFileSystem", "_strip_protocol"),
    "call_s3": ("s3fs", "S3FileSystem", "_call_s3"),
    "pipe_file": ("s3fs", "S3FileSystem", "_pipe_file"),
}


def strip_protocol(fs: Any, path: str) -> str:
    """``path`` as ``fs`` keys it (no protocol, no trailing slash)."""
    return str(fs._strip_protocol(path))


def call_s3(fs: Any, method: str, **kwargs: Any) -> Any:
    """An awaitable S3 API call ``method`` through s3fs's client (its retries, credentials, endpoint)."""
    return fs._call_s3(method, **kwargs)


def pipe_file(fs: Any, path: str, data: bytes, **kwargs: Any) -> Any:
    """An awaitable single-object write with extra S3 arguments (``ChecksumCRC32=...``, ``mode="create"``)."""
    return fs._pipe_file(path, data, **kwargs)


def pipe_file_method(cls: Any) -> Any:
    """The method `pipe_file` calls on a filesystem class (its signature says which arguments it takes)."""
    return getattr(cls, "_pipe_file", cls.pipe_file)


def check_private_names() -> List[Tuple[str, str]]:
    """Probe every name above; ``(name, problem)`` for each that is gone (s3fs's only where it is installed)."""
    problems: List[Tuple[str, str]] = []
    for name, (module, cls, attr) in NAMES.items():
        try:
            owner = getattr(importlib.import_module(module), cls)
        except ImportError:
            continue  # an optional backend that is not installed: nothing uses it
        if not callable(getattr(owner, attr, None)):
            version = getattr(importlib.import_module(module.split(".")[0]), "__version__", "?")
            problems.append((name, f"{module.split('.')[0]} {version} has no {cls}.{attr}: update storage/_compat.py"))
    return problems
