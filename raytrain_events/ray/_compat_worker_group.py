"""Ray Train V2's worker group, made to build replica groups of several workers (part of `_compat`'s table).

Ray 2.60's worker group has replica groups of any size inside (``_create_workers(replica_group_size=...)`` ranks
each group's workers together, `_TorchftBackend.on_start` gives each ``ReplicaGroup`` its own torch process group,
the controller replaces the failing groups alone), but three places build groups of one worker
(``worker_group.py``: "TODO: change after we support replica groups of size > 1"):

1. ``_start_impl`` asks ``_create_workers`` for ``replica_group_size=1`` when the backend manages replica groups;
2. ``_start_impl`` then makes one ``ReplicaGroup`` per worker (``[ReplicaGroup([worker], ...) for worker in
   workers]``) and maps world ranks to those;
3. ``_replace_replica_group_impl`` numbers a replaced group's workers from world rank ``replica_group_index`` in a
   world of ``len(self._replica_groups)``, right only for groups of one.

`install` wraps the three methods of ``WorkerGroup`` involved, each change only for a run whose backend config
carries ``replica_group_size > 1`` (`ShardedTorchftConfig`; every other run is left exactly as Ray runs it):
``_create_workers`` gets the group size (1) and, replacing group ``i``, world ranks from ``i * size`` in a world
of ``groups * size`` (3); ``_init_train_context``, which ``_start_impl`` calls right after (2) and before the
backend starts the groups' process groups, regroups the workers into groups of ``size`` consecutive world ranks
(`ReplicaLayout`) and maps the ranks to those. The wrapping happens in the process that runs the run's
controller: `ShardedTorchftConfig.backend_cls` (which the controller reads when it is built, before its worker
group exists) installs it there. `probe` checks every assumption above against the installed Ray's source and
signatures; `require` runs it on the driver before Ray starts, so an unsupported Ray is refused with the fix
instead of training groups of one in silence.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from typing import Any, List

from raytrain_events.core.replica_layout import ReplicaLayout
from raytrain_events.ray._compat_lookup import RayCompatError, _import, _missing, _ray_version
from raytrain_events.ray._compat_train import torchft_config_class

__all__ = ["install", "probe", "require", "sharded_torchft_config"]

_MODULE = "ray.train.v2._internal.execution.worker_group.worker_group"
_REPLACING = "_raytrain_events_replacing"  # the index of the group being replaced, while it is
_INSTALLED = "_raytrain_events_replica_group_size"
_lock = threading.Lock()


def _group_size(worker_group: Any) -> int:
    config = getattr(worker_group._train_run_context, "backend_config", None)
    return int(getattr(config, "replica_group_size", 1) or 1)


def _wrap_create_workers(original: Any) -> Any:
    @functools.wraps(original)
    def create_workers(  # noqa: PLR0913 (Ray's signature)
        self: Any,
        num_workers: int,
        placement_group: Any,
        resources_per_worker: Any,
        placement_group_bundle_indices: Any = None,
        starting_world_rank: int = 0,
        world_size: Any = None,
        replica_group_size: Any = None,
    ) -> Any:
        size = _group_size(self)
        if size > 1:
            replacing = getattr(self, _REPLACING, None)
            if replacing is not None:  # (3): Ray passes the group's index and the number of groups
                starting_world_rank = replacing * size
                world_size = len(self._replica_groups) * size
            elif replica_group_size == 1:  # (1): the whole group's start
                replica_group_size = size
        return original(
            self,
            num_workers,
            placement_group,
            resources_per_worker,
            placement_group_bundle_indices=placement_group_bundle_indices,
            starting_world_rank=starting_world_rank,
            world_size=world_size,
            replica_group_size=replica_group_size,
        )

    return create_workers


def _wrap_init_train_context(original: Any) -> Any:
    @functools.wraps(original)
    def init_train_context(self: Any, workers: List[Any], sync_actor: Any) -> Any:
        size = _group_size(self)
        groups = self._replica_groups
        starting = getattr(self, _REPLACING, None) is None
        if size > 1 and starting and groups and all(len(g.get_workers()) == 1 for g in groups):
            regroup(self, workers, size)  # (2)
        return original(self, workers, sync_actor)

    return init_train_context


def regroup(worker_group: Any, workers: List[Any], size: int) -> None:
    """Make ``worker_group``'s replica groups the `ReplicaLayout`'s: ``size`` consecutive world ranks each."""
    replica_group = _import("ray.train.v2._internal.execution.worker_group", "ReplicaGroup")
    ordered = sorted(workers, key=lambda w: w.distributed_context.world_rank)
    layout = ReplicaLayout(len(ordered), size)
    resources = worker_group._worker_group_context.resources_per_worker
    callbacks = worker_group._replica_group_callbacks
    worker_group._replica_groups = [
        replica_group([ordered[r] for r in layout.ranks_of(g)], resources, callbacks) for g in range(layout.groups)
    ]
    worker_group._worker_rank_to_replica_group_rank = {
        w.distributed_context.world_rank: layout.group_of(w.distributed_context.world_rank) for w in ordered
    }


def _wrap_replace(original: Any) -> Any:
    @functools.wraps(original)
    def replace_replica_group_impl(self: Any, replica_group_index: int) -> Any:
        setattr(self, _REPLACING, replica_group_index)
        try:
            return original(self, replica_group_index)
        finally:
            setattr(self, _REPLACING, None)

    return replace_replica_group_impl


def install() -> None:
    """Wrap Ray's ``WorkerGroup`` in this process (once; see the module doc)."""
    worker_group = _import(_MODULE, "WorkerGroup")
    with _lock:
        if getattr(worker_group, _INSTALLED, False):
            return
        require()
        worker_group._create_workers = _wrap_create_workers(worker_group._create_workers)
        worker_group._init_train_context = _wrap_init_train_context(worker_group._init_train_context)
        worker_group._replace_replica_group_impl = _wrap_replace(worker_group._replace_replica_group_impl)
        setattr(worker_group, _INSTALLED, True)


def _params(fn: Any) -> List[str]:
    return list(inspect.signature(fn).parameters)


def probe() -> None:
    """Raise `RayCompatError` naming what is gone when the installed Ray's worker group is not the one the module
    doc describes."""
    worker_group = _import(_MODULE, "WorkerGroup")
    module = importlib.import_module(_MODULE)
    expected = [
        "self",
        "num_workers",
        "placement_group",
        "resources_per_worker",
        "placement_group_bundle_indices",
        "starting_world_rank",
        "world_size",
        "replica_group_size",
    ]
    original = getattr(worker_group._create_workers, "__wrapped__", worker_group._create_workers)
    if _params(original) != expected:
        raise _missing(f"WorkerGroup._create_workers({', '.join(expected[1:])})")
    init = getattr(worker_group._init_train_context, "__wrapped__", worker_group._init_train_context)
    if _params(init) != ["self", "workers", "sync_actor"]:
        raise _missing("WorkerGroup._init_train_context(workers, sync_actor)")
    replace = getattr(worker_group._replace_replica_group_impl, "__wrapped__", worker_group._replace_replica_group_impl)
    if _params(replace) != ["self", "replica_group_index"]:
        raise _missing("WorkerGroup._replace_replica_group_impl(replica_group_index)")
    start = inspect.getsource(worker_group._start_impl)
    order = [
        "replica_group_size=1 if self._manages_replica_groups else None",
        "self._replica_groups = [",
        "self._worker_rank_to_replica_group_rank = {",
        "self._init_train_context(workers, sync_actor)",
        "callback.after_worker_group_start(self)",
    ]
    at = [start.find(part) for part in order]
    if -1 in at or at != sorted(at):
        raise _missing("WorkerGroup._start_impl building one ReplicaGroup per worker before _init_train_context")
    init_source = inspect.getsource(worker_group.__init__)
    for name in ("_train_run_context", "_worker_group_context", "_replica_group_callbacks", "_replica_groups"):
        if f"self.{name}" not in init_source:
            raise _missing(f"WorkerGroup.{name}")
    if "starting_world_rank=replica_group_index" not in inspect.getsource(replace):
        raise _missing("WorkerGroup._replace_replica_group_impl(starting_world_rank=replica_group_index)")
    replica_group = getattr(module, "ReplicaGroup", None)
    if replica_group is None or _params(replica_group.__init__) != [
        "self",
        "workers",
        "resources_per_worker",
        "callbacks",
    ]:
        raise _missing("ReplicaGroup(workers, resources_per_worker, callbacks)")
    backend = _import("ray.train.v2.torch.torchft_config", "_TorchftBackend")
    if "get_replica_groups()" not in inspect.getsource(backend.on_start):
        raise _missing("_TorchftBackend.on_start starting each replica group's process group")


def require() -> None:
    """Refuse (`RayCompatError`, with the fix) a Ray whose worker group `install` cannot make groups of several."""
    try:
        probe()
    except RayCompatError as error:
        raise RayCompatError(
            f"replica_group_size > 1 needs replica groups of several workers, which raytrain_events builds by wrapping "
            f"Ray Train V2's worker group (checked against Ray 2.60.0; this is Ray {_ray_version()}): {error} "
            "Fix: install ray==2.60.0, or use replica_group_size=1 (each worker a group holding a whole replica)."
        ) from error


def sharded_torchft_config(group_size: int, lighthouse_kwargs: Any, **torch_options: Any) -> Any:
    """Ray's ``TorchftConfig`` for replica groups of ``group_size`` workers (`ShardedTorchftConfig`)."""
    config = ShardedTorchftConfig(lighthouse_kwargs=lighthouse_kwargs, **torch_options)
    config.replica_group_size = group_size
    return config


class ShardedTorchftConfig(torchft_config_class()):  # type: ignore[misc]
    """``TorchftConfig`` with ``replica_group_size``: reading its backend (the controller does, when it is built)
    installs the worker group's wrapping in that process (`install`)."""

    replica_group_size: int = 1

    @property
    def backend_cls(self) -> Any:
        install()
        return super().backend_cls
