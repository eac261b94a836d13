"""Connect to Ray: the existing cluster when there is one, else an embedded local instance."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Mapping, Optional

from raytrain_events.ray import _compat
from raytrain_events.ray.embedded import local_instance
from raytrain_events.ray.reports.console import drop_noise_until_shutdown

__all__ = ["ensure_ray"]


def ensure_ray(address: Optional[str] = None, *, min_cpus: int = 0, verbose: bool = False, **init_kwargs: Any) -> bool:
    """Initialize Ray once; True if this call started an embedded local instance.

    Inside a cluster (``ray submit``, ``ray job submit``, or ``RAY_ADDRESS`` set) this connects
    to it; otherwise (or with ``address="local"``) it starts a local instance on 127.0.0.1 only
    (every address and listener, whether or not ``ray`` was imported before; see
    `raytrain_events.ray._compat.loopback_only`) with at least ``min_cpus`` logical CPUs (Ray Data
    needs CPUs beside the workers).
    Unless ``verbose``, Ray's own INFO lines stay off the terminal (see `raytrain_events.ray.reports.console`).
    """
    import ray

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

    with _compat.loopback_only() if local else contextlib.nullcontext():
        with local_instance(init_kwargs, verbose=verbose) if local else contextlib.nullcontext():
            ray.init(address=address, **init_kwargs)
    if local and not verbose:
        drop_noise_until_shutdown()
    return local


def _local_cluster_running() -> bool:
    """True if ``ray start`` left a cluster address on this machine (the head node of a cluster)."""

    path = _compat.ray_address_file()
    return os.path.exists(path) and os.path.getsize(path) > 0


def check_data_cpus(cluster_resources: Mapping[str, float], scaling_config: Any, datasets: Mapping[str, Any]) -> None:
    """Refuse a run whose train workers would take every CPU that Ray Data's tasks need.

    Ray Data reads and transforms in tasks of 1 CPU each by default; when the workers hold all
    CPUs those tasks never start and the run hangs forever ("Cluster resources are not enough
    to run any task"). Datasets already in the object store (``from_items``, ``materialize()``)
    need no tasks and pass.
    """
    from ray.data.dataset import MaterializedDataset

    needing = sorted(name for name, ds in datasets.items() if not isinstance(ds, MaterializedDataset))
    if not needing:
        return
    cpus = float(cluster_resources.get("CPU", 0))
    workers = scaling_config.max_workers
    per_worker = float(scaling_config.num_cpus_per_worker)
    taken = workers * per_worker
    if cpus - taken >= 1:
        return
    raise RuntimeError(
        f"This Ray cluster has {cpus:g} CPUs and the {workers} train workers take {per_worker:g} each "
        f"({taken:g} in all), leaving {max(cpus - taken, 0):g} for Ray Data, whose read and map tasks need 1 CPU "
        f"each: the dataset(s) {needing} would never be read and the run would hang. Fixes: use fewer workers "
        f"(num_workers={max(int((cpus - 1) // per_worker), 1) if per_worker else workers}), give each worker "
        f"a fraction of a CPU (resources_per_worker={{'CPU': 0.5}}), run on a larger cluster, or let RayTrainer "
        "start Ray itself (it starts a local instance with a CPU to spare; do not call ray.init or touch "
        "ray.data before RayTrainer.fit)."
    )
