"""Connect to Ray: the existing cluster when there is one, else an embedded local instance."""
from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["ensure_ray"]


def ensure_ray(address: Optional[str] = None, **init_kwargs: Any) -> None:
    """Initialize Ray once.

    Inside a cluster (``ray submit``, ``ray job submit``, or ``RAY_ADDRESS`` set) this connects
    to it; otherwise it starts a local instance bound to 127.0.0.1.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and _local_cluster_running():
        address = "auto"
    if address is None:
        # An embedded single-machine cluster needs no external interface: keep it on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    init_kwargs.setdefault("log_to_driver", True)
    ray.init(address=address, **init_kwargs)


def _local_cluster_running() -> bool:
    """True if ``ray start`` left a cluster address on this machine (the head node of a cluster)."""
    path = "/tmp/ray/ray_current_cluster"
    return os.path.exists(path) and os.path.getsize(path) > 0
