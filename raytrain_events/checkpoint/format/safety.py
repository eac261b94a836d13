"""The torch floor that our "safe to load" promise rests on, checked before any checkpoint load.

Every load goes through ``torch.load(weights_only=True)`` and, for sharded checkpoints, DCP's
tensor reads (which use the same weights-only unpickler). That unpickler had known bypasses
(code execution or memory corruption from a crafted file) up to torch 2.5.1 (fixed in 2.6) and
up to 2.9.1 (GHSA-63cw-57p8-fm3p, fixed in 2.10.0). ``pyproject.toml`` requires
``torch>=2.10``; this check catches what pip's resolver does not: a cluster image whose torch
was installed first, ``pip install --no-deps``, or a pinned older wheel. It refuses the load
rather than training on: a load from an untrusted bucket is exactly where the bypass bites.

Chosen over "old torch trains, loads need ``trusted=True``": one more knob on every load path
for a configuration nobody should run, and a flag users copy from snippets without reading.
"""

from __future__ import annotations

import re

import torch

from raytrain_events.checkpoint.format.manifest import UnsafeCheckpointError

__all__ = ["ADVISORY", "SAFE_TORCH", "require_safe_torch"]

#: The oldest torch whose weights-only unpickler has no published bypass.
SAFE_TORCH = (2, 10)
ADVISORY = "GHSA-63cw-57p8-fm3p"


def _torch_version() -> str:
    return str(torch.__version__)


def _parse(version: str) -> tuple:
    m = re.match(r"^(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def require_safe_torch(what: str = "a checkpoint") -> None:
    """Raise `UnsafeCheckpointError` if this torch's weights-only unpickler has a known bypass."""
    version = _torch_version()
    if _parse(version) >= SAFE_TORCH:
        return

    raise UnsafeCheckpointError(
        f"Refused to load {what} with torch {version}: its weights-only unpickler, which keeps a crafted "
        f"checkpoint from running code, has a known bypass ({ADVISORY}; fixed in torch "
        f"{SAFE_TORCH[0]}.{SAFE_TORCH[1]}). Nothing was read. Fix: pip install 'torch>={SAFE_TORCH[0]}.{SAFE_TORCH[1]}' "
        "(raytrain_events requires it; this torch was installed around that requirement)."
    )
