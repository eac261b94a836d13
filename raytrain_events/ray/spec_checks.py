"""The checks of `RunSpec`'s options that need no data and no user code: each option's value, and the
combinations of options that cannot train as asked.

`RunSpec.__post_init__` calls `check_data_and_scaling` and `check_run_options` (so a Tune trial's
overrides, applied with `RunSpec.replace`, are checked the same way, and a sweep checks its grid
values through it before any trial trains). What needs the datasets' metadata is checked in
`raytrain_events.ray.data_checks` and what needs the user's code in `raytrain_events.ray.driver_checks`,
both on the driver before Ray starts (`tune/sweep_checks.py` runs them for a sweep). Every message
names the option, the problem and the fix. Cost: a few comparisons; one ``stat`` per parent of a
local ``storage_path`` that does not exist yet.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

from raytrain_events.core.time import TimeUnit, ensure_time
from raytrain_events.ray.plan import mixture_run

RunSpec = Any  # a `raytrain_events.ray.spec.RunSpec`, which imports this module (no import back: no cycle)
__all__ = ["check_data_and_scaling", "check_mesh", "check_run_options", "check_ray_storage"]

_RESOURCE_NAMES = {"cpu": "CPU", "gpu": "GPU", "memory": "memory", "object_store_memory": "object_store_memory"}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_data_and_scaling(spec: RunSpec) -> None:
    """``datasets``, ``mixture``, ``batch_size``, ``num_workers``/``scaling_config``/``use_gpu``/
    ``resources_per_worker``, ``columns``, ``global_batch_size``, ``shuffle_buffer_size`` and ``steps_per_epoch``."""
    _check_datasets(spec)
    if not _positive_int(spec.data.batch_size):
        raise ValueError(f"batch_size={spec.data.batch_size!r} must be a positive integer (rows per worker per batch).")
    if spec.scaling.scaling_config is not None and (
        spec.scaling.num_workers is not None or spec.scaling.use_gpu or spec.scaling.resources_per_worker is not None
    ):
        raise ValueError(
            "Pass either scaling_config or num_workers/use_gpu/resources_per_worker, not both "
            f"(got scaling_config={spec.scaling.scaling_config!r}, num_workers={spec.scaling.num_workers!r})."
        )
    workers = spec.scaling.workers
    counts = workers if isinstance(workers, tuple) else (workers,)
    if (
        len(counts) not in (1, 2)
        or not all(_positive_int(n) for n in counts)
        or (len(counts) == 2 and counts[0] > counts[1])
    ):
        raise ValueError(
            f"num_workers={workers!r} must be an integer >= 1, or (min, max) with 1 <= min <= max for an elastic group."
        )
    if (
        spec.scaling.num_workers is not None or spec.scaling.scaling_config is not None
    ):  # not the workers' copy (for_workers)
        check_mesh(spec)
    if not isinstance(spec.scaling.use_gpu, bool):
        fix = "True" if str(spec.scaling.use_gpu).strip().lower() in ("true", "1", "yes") else "False"
        raise TypeError(
            f"use_gpu={spec.scaling.use_gpu!r} must be True or False (a bool, not {type(spec.scaling.use_gpu).__name__}). "
            f"Fix: use_gpu={fix}."
        )
    _check_resources(spec.scaling.resources_per_worker)
    if spec.data.columns is not None and (
        isinstance(spec.data.columns, str) or not all(isinstance(c, str) for c in spec.data.columns)
    ):
        fix = [spec.data.columns] if isinstance(spec.data.columns, str) else ["image", "label"]
        raise TypeError(f"columns={spec.data.columns!r} must be a list of column names. Fix: columns={fix!r}.")
    _check_global_batch(spec)
    _check_shuffle(spec)
    if spec.data.steps_per_epoch is not None and not _positive_int(spec.data.steps_per_epoch):
        raise ValueError(
            f"steps_per_epoch={spec.data.steps_per_epoch!r} must be a positive integer (global batches per epoch), or "
            "None to count them from the train set's rows."
        )


def _check_datasets(spec: RunSpec) -> None:
    # The mixture is plain data and a datasets mapping a dict already (`DataOptions.of`).
    if isinstance(spec.data.datasets, Mapping):
        if "train" not in spec.data.datasets and spec.data.mixture is None:
            raise ValueError(
                f"datasets has no 'train' entry (got {sorted(spec.data.datasets)}); pass datasets={{'train': ds, ...}}."
            )
    elif not callable(spec.data.datasets):
        raise TypeError(f"datasets must be a dict of Ray Datasets or fn(config) -> dict, got {spec.data.datasets!r}.")


def check_mesh(spec: RunSpec) -> None:
    """HSDP's ``replicate`` x context x tensor parallelism must divide a fixed number of workers
    (`FSDPConfig.mesh_shape`, the one owner of that rule); an elastic group is checked at each start."""
    fsdp = spec.parallelism_spec.fsdp
    if fsdp is not None and isinstance(spec.scaling.workers, int):
        fsdp.mesh_shape(spec.scaling.workers)


def _check_resources(resources: Any) -> None:
    if resources is None:
        return
    if not isinstance(resources, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        for k, v in resources.items()
    ):
        raise TypeError(
            f"resources_per_worker={resources!r} must map Ray resource names to amounts, "
            "like resources_per_worker={'CPU': 2} or {'CPU': 4, 'GPU': 1}."
        )
    wrong = {k: _RESOURCE_NAMES[k.lower()] for k in resources if k.lower() in _RESOURCE_NAMES}
    wrong = {k: v for k, v in wrong.items() if k != v}
    if wrong:  # Ray reads {'cpu': 1} as a custom resource no node has: the workers would wait for ever
        fixed = {wrong.get(k, k): v for k, v in resources.items()}
        raise ValueError(
            f"resources_per_worker={resources!r} names {sorted(wrong)}: Ray's resources are {sorted(set(wrong.values()))}"
            f" (upper case; another spelling is a custom resource no node has, and the run would wait for ever). "
            f"Fix: resources_per_worker={fixed!r}."
        )


def _check_global_batch(spec: RunSpec) -> None:
    value = spec.data.global_batch_size
    if value is None:
        return
    if not _positive_int(value):
        raise ValueError(
            f"global_batch_size={value!r} must be a positive integer (rows per optimizer step), or None for "
            "batch_size x workers."
        )
    workers = spec.scaling.workers
    smallest = workers[1] if isinstance(workers, tuple) else workers  # an elastic group may grow to its max
    readers = smallest // max(1, spec.parallelism_spec.batch_group) if _positive_int(smallest) else 1
    if value < readers:
        raise ValueError(
            f"global_batch_size={value} is smaller than the {readers} data-parallel workers: some rank would get no "
            f"row of a batch. Fix: global_batch_size >= {readers} (e.g. {readers * spec.data.batch_size}), or fewer "
            "workers."
        )


def _check_shuffle(spec: RunSpec) -> None:
    value = spec.data.shuffle_buffer_size
    if value is None:
        return
    if isinstance(value, str) and value.strip().isdigit():
        raise TypeError(f"shuffle_buffer_size={value!r} is a string. Fix: shuffle_buffer_size={int(value)} (rows).")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"shuffle_buffer_size={value!r} must be a number of rows >= 1 (e.g. 10_000), or None (0) for no "
            "row shuffle."
        )
    if value and spec.seed is None:
        raise ValueError(
            f"shuffle_buffer_size={value} with seed=None: the train order is shuffled by seed + epoch, so without a "
            "seed the rows would not be shuffled at all. Fix: pass a seed (seed=0, the default, or any integer), or "
            "leave shuffle_buffer_size unset."
        )


def check_run_options(spec: RunSpec) -> None:
    """The reporting, failure and storage options, and a mixture's stages against the run's length."""
    every = spec.reports.report_every_s
    if every is not None and (
        isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every <= 0
    ):
        raise ValueError(
            f"report_every_s={every!r} must be a positive number of seconds (each report is a barrier across the "
            "workers: keep it at several seconds, e.g. 10), or None to report only at report_interval."
        )
    if spec.reports.report_interval is not None:
        interval = ensure_time(spec.reports.report_interval, TimeUnit.BATCH)
        if interval.value <= 0 or (interval.unit == TimeUnit.DURATION and interval.value > 1):
            raise ValueError(
                f"report_interval={spec.reports.report_interval!r} must be a positive Time within the run ('500ba', '1ep', "
                "'0.1dur'; in 'dur' at most '1dur'), or None to report every report_every_s seconds."
            )
    failures = spec.failures.max_failures
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < -1:
        fix = int(failures) if isinstance(failures, str) and failures.strip().lstrip("-").isdigit() else 3
        raise TypeError(
            f"max_failures={failures!r} must be an integer: restarts after a failure (0: none, -1: without limit). "
            f"Fix: max_failures={fix}."
        )
    check_ray_storage(spec.storage.storage_path, "storage_path")
    if spec.data.mixture is not None:
        mixture_run(spec)  # a stage the run cannot place: after its end, out of order, 'dur' in tokens


def check_ray_storage(url: Optional[str], what: str) -> None:
    """A storage URL Ray's workers can share: not ``memory://``, and a local path not inside a file."""
    if url is None:
        return
    url = os.fspath(url)
    if url.startswith("memory://"):
        raise ValueError(
            f"{what}={url!r}: memory:// storage lives inside one process and Ray workers are separate processes. "
            "Fix: a local path, file://, s3://, gs:// or az:// for a Ray run."
        )
    if "://" in url and not url.startswith("file://"):
        return
    path = os.path.abspath(os.path.expanduser(url[len("file://") :] if url.startswith("file://") else url))
    parent = path
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up
    if not os.path.isdir(parent):
        raise NotADirectoryError(
            f"{what}={url!r} is inside {parent!r}, which is a file, not a folder: no run folder can be made there. "
            "Fix: point it at a folder (or a path that does not exist yet), or move that file away."
        )
