"""Connect to Ray: the existing cluster when there is one, else an embedded local instance."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

__all__ = ["ensure_ray"]


def ensure_ray(address: Optional[str] = None, *, min_cpus: int = 0, verbose: bool = False, **init_kwargs: Any) -> bool:
    """Initialize Ray once; True if this call started an embedded local instance.

    Inside a cluster (``ray submit``, ``ray job submit``, or ``RAY_ADDRESS`` set) this connects
    to it; otherwise (or with ``address="local"``) it starts a local instance on 127.0.0.1 only
    (every address and listener, whether or not ``ray`` was imported before; see
    `raytrain_events.ray._compat.loopback_only`) with at least ``min_cpus`` logical CPUs (Ray Data
    needs CPUs beside the workers).
    Unless ``verbose``, Ray's own INFO lines stay off the terminal (see `raytrain_events.ray.console`).
    """
    import ray

    from raytrain_events.ray import _compat

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and _local_cluster_running():
        address = "auto"
    local = address in (None, "local")
    if local:
        if min_cpus and "num_cpus" not in init_kwargs:
            init_kwargs["num_cpus"] = max(os.cpu_count() or 1, min_cpus)
        # An embedded single-machine instance needs no external interface: keep it on loopback.
        init_kwargs = {**_compat.LOOPBACK_INIT_KWARGS, **init_kwargs}
    init_kwargs.setdefault("log_to_driver", True)
    if not verbose:
        init_kwargs.setdefault("logging_level", logging.WARNING)
    from raytrain_events.ray.console import local_instance

    with _compat.loopback_only() if local else contextlib.nullcontext():
        with local_instance(init_kwargs, verbose=verbose) if local else contextlib.nullcontext():
            ray.init(address=address, **init_kwargs)
    return local


def _local_cluster_running() -> bool:
    """True if ``ray start`` left a cluster address on this machine (the head node of a cluster)."""
    path = "/tmp/ray/ray_current_cluster"
    return os.path.exists(path) and os.path.getsize(path) > 0
