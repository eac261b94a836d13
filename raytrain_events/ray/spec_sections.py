"""The sections of a `RunSpec`: its run-level options grouped by what they decide, each a frozen dataclass.

`RayTrainer(**options)` stays flat (every keyword is one option); `RunSpec` files each run-level
option into one section, built once by the section's ``of`` (which makes the final values: a
storage URL made absolute, a fresh run name, the mixture as plain data) and never changed after:

* ``spec.data``: `DataOptions`: the datasets (or their mixture), the batch, how rows reach it.
* ``spec.scaling``: `ScalingOptions`: how many Ray Train workers, on what resources.
* ``spec.storage``: `StorageOptions`: where the run's folder lives and its name.
* ``spec.checkpoints``: `CheckpointOptions`: the checkpoint config and validation on checkpoints.
* ``spec.reports``: `ReportOptions`: what reaches the driver, how often, and what it shows.
* ``spec.failures``: `FailureOptions`: restarts, replica groups and the hang watchdog.

Each field is declared with `raytrain_events.trainer.options.option` (its ``help``, and ``worker=False``
for a driver-only option), like a `LoopOptions` field. Adding a run option = one field in its
section + the place that uses it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from raytrain_events.core.mixture import Mixture
from raytrain_events.ray.async_validation import parse_validation
from raytrain_events.trainer.options import option

__all__ = [
    "CheckpointOptions",
    "DataOptions",
    "FailureOptions",
    "ReportOptions",
    "ScalingOptions",
    "StorageOptions",
    "option_fields",
    "storage_root",
]

Factory = Callable[..., Any]
_opt = option  # a run option: its help, and worker=False for a driver-only one


def option_fields(cls: type) -> List[dataclasses.Field]:  # type: ignore[type-arg]
    """A section's options (the fields with a ``help``), in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """What the workers read: the datasets (or the mixture of them), the batch, and how rows reach it."""

    datasets: Union[Mapping[str, Any], Factory] = _opt(
        help="{'train': ray.data.Dataset or ParquetRowGroups(paths), <eval name>: Dataset, ...}, or fn(config) -> "
        "that dict (called on the driver when the run starts); every name besides 'train' is an eval set; "
        "ParquetRowGroups(paths, a folder or s3://bucket/prefix/) or a bare ray.data.read_parquet(...) "
        "(data/ray/parquet_seek.py): a resume reads nothing before its position",
        worker=False,
    )
    mixture: Any = _opt(
        None,
        help="a Mixture (or its dict) of seekable datasets entries: the train set (data/ray/mixture_source.py)",
        worker=False,
    )
    batch_size: int = _opt(64, help="rows per worker per batch")
    eval_batch_size: Optional[int] = _opt(None, help="eval rows per worker per batch (default: batch_size)")
    eval_options: Dict[str, Dict[str, Any]] = _opt(
        help="per eval set, Evaluator options: {'val': {'eval_interval': '100ba', 'subset_num_batches': 5}}",
        factory=dict,
    )
    get_num_tokens_in_batch: Optional[Callable[[Any], int]] = _opt(
        None, help="fn(batch) -> tokens in it; needed to count tokens (and for durations in 'tok')"
    )
    collate_fn: Optional[Callable] = _opt(None, help="fn(numpy batch dict) -> batch, on the worker")  # type: ignore[type-arg]
    prefetch_batches: int = _opt(1, help="batches Ray Data prefetches per worker")
    shuffle_buffer_size: Optional[int] = _opt(
        None,
        help="train (with seed): blocks permuted, then rows within windows of this many rows, by seed + epoch; "
        "eval: Ray Data local shuffle rows",
    )
    columns: Optional[List[str]] = _opt(None, help="only these dataset columns reach the batch")
    steps_per_epoch: Optional[int] = _opt(
        None, help="global batches per epoch (default: from the row count in the train set's metadata)"
    )
    deterministic_split: bool = _opt(
        False, help="materialize the train set once per worker group; split eval sets by rank", worker=False
    )
    global_batch_size: Optional[int] = _opt(
        None, help="rows per optimizer step at any world size (default: batch_size * workers)", worker=False
    )

    @classmethod
    def of(cls, **options: Any) -> DataOptions:
        """The section with its final values: the mixture as plain data (config.yaml, Tune; a bad one fails
        here with a MixtureError), a datasets mapping as a dict."""
        if options.get("mixture") is not None:
            options["mixture"] = Mixture.plain(options["mixture"])
        if isinstance(options.get("datasets"), Mapping):
            options["datasets"] = dict(options["datasets"])
        return cls(**options)

    @property
    def eval_names(self) -> List[str]:
        """The eval datasets' names: every dataset but ``"train"`` (and the mixture's sources)."""
        if not isinstance(self.datasets, Mapping):
            return []
        sources = set(self.mixture["sources"]) if self.mixture is not None else set()
        return sorted(k for k in self.datasets if k != "train" and k not in sources)


@dataclass(frozen=True, kw_only=True)
class ScalingOptions:
    """How many Ray Train workers, on what resources."""

    num_workers: Any = _opt(
        None, help="Ray Train workers (default 1), or (min, max) for an elastic group", worker=False
    )
    use_gpu: bool = _opt(False, help="one GPU per worker", worker=False)
    resources_per_worker: Optional[Dict[str, float]] = _opt(
        None, help="Ray resources per worker, e.g. {'CPU': 4, 'GPU': 1}", worker=False
    )
    scaling_config: Any = _opt(
        None,
        help="a ray.train.ScalingConfig (or its kwargs); instead of num_workers/use_gpu/resources_per_worker",
        worker=False,
    )

    @classmethod
    def of(cls, **options: Any) -> ScalingOptions:
        """The section with its final values: an elastic ``[min, max]`` as a tuple."""
        if isinstance(options.get("num_workers"), list):
            options["num_workers"] = tuple(options["num_workers"])
        return cls(**options)

    @property
    def workers(self) -> Any:
        """The number of Ray Train workers (from ``scaling_config`` when given)."""
        if self.scaling_config is None:
            return 1 if self.num_workers is None else self.num_workers
        if isinstance(self.scaling_config, Mapping):
            return self.scaling_config.get("num_workers", 1)
        return self.scaling_config.num_workers

    def ray_scaling_config(self) -> Any:
        """The ``ray.train.ScalingConfig`` for this run."""
        from ray.train import ScalingConfig  # deferred: Ray is heavy, and this module is imported without it

        if self.scaling_config is None:
            return ScalingConfig(
                num_workers=self.workers, use_gpu=self.use_gpu, resources_per_worker=self.resources_per_worker
            )
        if isinstance(self.scaling_config, Mapping):
            return ScalingConfig(**self.scaling_config)
        return self.scaling_config


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """Where the run's folder lives (``<storage_path>/<run_name>``) and how to reach it."""

    storage_path: str = _opt(None, help="where runs live: a local path or fsspec URL (default ./runs)")
    storage_options: Dict[str, Any] = _opt(help="fsspec options for storage_path", factory=dict)
    run_name: str = _opt(
        None, help="the run's folder under storage_path: one folder name (default: a fresh run-<date>-<time>-<hex>)"
    )
    # Not an option: True when no run_name was given and `of` made a fresh one (autoresume needs a name).
    default_run_name: bool = field(default=False)

    @classmethod
    def of(cls, **options: Any) -> StorageOptions:
        """The section with its final values: an absolute local path or a URL, a run name (a fresh unique one
        when none is given, so two jobs never share a run directory)."""
        # Deferred: storage/ imports fsspec, which `import raytrain_events` does not pull in (tests/core/test_imports.py).
        # why here: defers fsspec until this runs
        from raytrain_events.storage.exp_dir import check_run_name, fresh_run_name
        from raytrain_events.storage.fs import check_storage_url

        storage_path, run_name = options.get("storage_path"), options.get("run_name")
        check_storage_url(storage_path or "runs")
        return cls(
            storage_path=storage_root(storage_path),
            storage_options=dict(options.get("storage_options") or {}),
            run_name=fresh_run_name() if run_name is None else check_run_name(run_name),
            default_run_name=run_name is None,
        )

    @property
    def run_url(self) -> str:
        """Where this run's files live: ``<storage_path>/<run_name>``."""
        # why here: defers fsspec until this runs
        from raytrain_events.storage.fs import join  # deferred: fsspec (see `of`)

        return join(self.storage_path, self.run_name)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """The checkpoint config, and validation on checkpoints as Ray tasks."""

    checkpoint: Any = _opt(None, help="a raytrain_events.checkpoint.CheckpointConfig; None: no checkpoints")
    validation: Any = _opt(
        None,
        help="None: evaluate the eval sets in the loop; 'async' or AsyncValidation(datasets=[...], every=..., "
        "resources=...) (ray/checkpointing/validation.py): evaluate them as Ray tasks on checkpoints while training goes on",
    )

    @classmethod
    def of(cls, **options: Any) -> CheckpointOptions:
        """The section with its final values: ``validation`` parsed; the checkpoint config with the run dir's
        lock and the config-change notice left to the driver (it holds the lock for the whole run and announces
        a changed config once, ray/reports/console.announce_config_change)."""
        checkpoint = options.get("checkpoint")
        if checkpoint is not None:
            if getattr(checkpoint, "save_folder", None):
                raise ValueError(
                    "CheckpointConfig.save_folder cannot be set for a RayTrainer run: checkpoints live in the run "
                    "directory (<storage_path>/<run_name>/checkpoints) so Ray Train can manage them. "
                    "Set storage_path instead."
                )
            # why here: defers fsspec until this runs
            from raytrain_events.checkpoint.folder.retention import check_ray_ranking

            check_ray_ranking(checkpoint)
            checkpoint = dataclasses.replace(checkpoint, lock_run_dir=False, announce_config_change=False)
        return cls(checkpoint=checkpoint, validation=parse_validation(options.get("validation")))


@dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """What the workers report to the driver, how often, and what the driver shows and logs."""

    report_interval: Any = _opt(None, help="report to the driver every this many: '500ba', '1ep', ...")
    report_every_s: Optional[float] = _opt(10.0, help="report to the driver at least every this many seconds")
    ray_callbacks: Sequence[Any] = _opt((), help="extra ray.train.UserCallback objects", worker=False)
    progress_bar: Optional[bool] = _opt(
        None, help="one progress bar on the driver; None: when stderr is a terminal", worker=False
    )
    verbose: bool = _opt(
        False, help="also show Ray's own log lines on the terminal (they always go to Ray's log files)", worker=False
    )
    driver_loggers: Sequence[Any] = _opt(
        (),
        help="logger destinations (FileLogger, TensorBoardLogger, MLFlowLogger, WandBLogger), fed on the driver "
        "once per report with metrics reduced across ranks",
        worker=False,
    )
    log_step: str = _opt(
        "sample",
        help="the global Timestamp unit loggers use as the step: 'sample', 'batch', 'token' or 'epoch'",
        worker=False,
    )

    @classmethod
    def of(cls, **options: Any) -> ReportOptions:
        """The section with its final values: the driver's loggers as a list."""
        options["driver_loggers"] = list(options.get("driver_loggers") or ())
        return cls(**options)


@dataclass(frozen=True, kw_only=True)
class FailureOptions:
    """How the run survives a failure: Ray Train's restarts, replica groups, and the hang watchdog."""

    max_failures: int = _opt(0, help="worker-group restarts Ray Train makes after a failure", worker=False)
    fault_tolerance: Optional[str] = _opt(None, help="None, or 'replica_groups' (checked in ray/replica_checks.py)")
    replica_timeout_s: float = _opt(30.0, help="replica groups: a collective's or peer transfer's limit (quorum: 2x)")
    replica_group_size: int = _opt(
        1,
        help="replica groups: workers per group, the model sharded inside each with FSDP, HSDP or FSDP x TP (groups = "
        "num_workers / this; checked in ray/replica_checks.py)",
    )
    hang_timeout: Optional[float] = _opt(
        None,
        help="seconds without progress on any rank before the watchdog saves every rank's stacks in <run>/hangs "
        "and restarts the group (None: max(300, 20 x median step)); also the start-up check's deadline and, with "
        "a margin, the process-group timeout",
    )

    @classmethod
    def of(cls, **options: Any) -> FailureOptions:
        """The section (its values are final as given; checked in ray/spec_checks.py and ray/replica_checks.py)."""
        return cls(**options)


def storage_root(storage_path: Optional[str]) -> str:
    """A storage URL, or an absolute local path (``None``: ``./runs``)."""
    if storage_path is None:
        return os.path.abspath("runs")
    storage_path = os.fspath(storage_path)
    if "://" not in storage_path:
        return os.path.abspath(os.path.expanduser(storage_path))
    if storage_path.startswith("file://"):
        return os.path.abspath(storage_path[len("file://") :])
    return storage_path
