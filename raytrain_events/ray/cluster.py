"""Connect to Ray: the existing cluster when there is one, else an embedded local instance."""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["ensure_ray"]


def ensure_ray(address: Optional[str] = None, *, min_cpus: int = 0, **init_kwargs: Any) -> bool:
    """Initialize Ray once; True if this call started an embedded local instance.

    Inside a cluster (``ray submit``, ``ray job submit``, or ``RAY_ADDRESS`` set) this connects
    to it; otherwise (or with ``address="local"``) it starts a local instance bound to
    127.0.0.1 with at least ``min_cpus`` logical CPUs (Ray Data needs CPUs beside the workers).
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and _local_cluster_running():
        address = "auto"
    local = address in (None, "local")
    if local:
        # An embedded single-machine cluster needs no external interface: keep it on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if min_cpus and "num_cpus" not in init_kwargs:
            init_kwargs["num_cpus"] = max(os.cpu_count() or 1, min_cpus)
    init_kwargs.setdefault("log_to_driver", True)
    ray.init(address=address, **init_kwargs)
    return local


def _local_cluster_running() -> bool:
    """True if ``ray start`` left a cluster address on this machine (the head node of a cluster)."""
    path = "/tmp/ray/ray_current_cluster"
    return os.path.exists(path) and os.path.getsize(path) > 0
