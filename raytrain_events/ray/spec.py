"""`RunSpec`: the one definition of a `RayTrainer` run's options.

Every option of a Ray run is a field here, with its default and its meaning (``help``). The rest
is derived from these fields: `RayTrainer(**options)` builds a `RunSpec` (its keyword arguments are
exactly these fields), `RunSpec.describe` is the run's config.yaml, a Tune trial's overrides are
`RunSpec.replace` (``dataclasses.replace``, so they are validated again), and the worker builds
its `Trainer` from the spec in one function (`raytrain_events.ray.worker.build_worker_trainer`).
The loop's own options are inherited from `raytrain_events.trainer.options.LoopOptions`, the one
definition `Trainer` uses too; the worker passes the spec to its `Trainer` as those options.
Adding a Ray option = one field here + the place that uses it (a loop option: a `LoopOptions` field).

Models, optimizers and schedulers travel as factories (functions called on the worker), so a
large model is never pickled on the driver and each worker builds its own on its own device.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from raytrain_events.core.time_value import check_countable
from raytrain_events.ray.spec_checks import check_data_and_scaling, check_run_options
from raytrain_events.trainer.options import LoopOptions, option, refuse_unknown

__all__ = ["RunSpec", "option_names"]

Factory = Callable[..., Any]


_opt = option  # a RunSpec field: `LoopOptions`' own field helper (help, and worker=False for driver-only)


@dataclass(kw_only=True)
class RunSpec(LoopOptions):
    """Everything a `RayTrainer` run needs; each field is also a `RayTrainer` keyword argument.

    The loop's options (``max_duration``, ``eval_interval``, ``grad_accum``, ``precision``,
    ``parallelism``, ``compile``, ``seed``, ``config``) are the inherited `LoopOptions` fields: the
    same names, defaults and checks as `Trainer`'s, and the worker hands this spec to its `Trainer`
    as its ``options``. ``max_duration`` is required here (a Ray run always trains).

    Validated on construction (and on every `replace`), so bad input fails on the driver with a
    message naming the option, before any worker starts.
    """

    # -- what to train ------------------------------------------------------------------------
    model: Factory = _opt(help="model(config) -> nn.Module, called on each worker (config may be omitted)")
    optimizers: Factory = _opt(help="optimizers(model, config) -> optimizer(s), called on each worker")
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
    schedulers: Optional[Any] = _opt(None, help="schedulers(optimizers, config) -> scheduler(s), or ready schedules")
    algorithms: Union[Sequence[Any], Factory] = _opt(
        (), help="algorithm instances or specs ('label_smoothing', {'name': 'mixup', 'alpha': 0.2}), or a factory"
    )
    callbacks: Union[Sequence[Any], Factory] = _opt((), help="callback instances, or callbacks(config) -> list")
    # -- the loop -----------------------------------------------------------------------------
    eval_batch_size: Optional[int] = _opt(None, help="eval rows per worker per batch (default: batch_size)")
    eval_options: Dict[str, Dict[str, Any]] = _opt(
        help="per eval set, Evaluator options: {'val': {'eval_interval': '100ba', 'subset_num_batches': 5}}",
        factory=dict,
    )
    validation: Any = _opt(
        None,
        help="None: evaluate the eval sets in the loop; 'async' or AsyncValidation(datasets=[...], every=..., "
        "resources=...) (ray/checkpointing/validation.py): evaluate them as Ray tasks on checkpoints while training goes on",
    )
    get_num_tokens_in_batch: Optional[Callable[[Any], int]] = _opt(
        None, help="fn(batch) -> tokens in it; needed to count tokens (and for durations in 'tok')"
    )
    # -- data -----------------------------------------------------------------------------------
    collate_fn: Optional[Callable] = _opt(None, help="fn(numpy batch dict) -> batch, on the worker")
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
    # -- scaling ----------------------------------------------------------------------------------
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
    # -- storage, checkpoints, reports -------------------------------------------------------------
    storage_path: Optional[str] = _opt(None, help="where runs live: a local path or fsspec URL (default ./runs)")
    storage_options: Dict[str, Any] = _opt(help="fsspec options for storage_path", factory=dict)
    run_name: Optional[str] = _opt(
        None, help="the run's folder under storage_path: one folder name (default: a fresh run-<date>-<time>-<hex>)"
    )
    checkpoint: Any = _opt(None, help="a raytrain_events.checkpoint.CheckpointConfig; None: no checkpoints")
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

    def __post_init__(self) -> None:
        # The loop options, checked once here (LoopOptions); the driver's progress bar and the workers'
        # Trainer receive the typed values (max_duration a Time).
        super().__post_init__()
        if self.max_duration is None:
            raise TypeError("RayTrainer needs max_duration (e.g. max_duration='2ep').")
        check_countable(self.max_duration, counts_tokens=self.get_num_tokens_in_batch is not None, what="max_duration")
        for name, options in (self.eval_options or {}).items():
            unknown = sorted(set(options) - {"eval_interval", "subset_num_batches", "metric_names"})
            if unknown:
                raise ValueError(
                    f"eval_options[{name!r}] has unknown keys {unknown}: use eval_interval, subset_num_batches, "
                    "metric_names."
                )
        if self.hang_timeout is not None and (
            not isinstance(self.hang_timeout, (int, float))
            or isinstance(self.hang_timeout, bool)
            or self.hang_timeout <= 0
        ):
            raise ValueError(
                f"hang_timeout={self.hang_timeout!r} must be a positive number of seconds, or None for "
                "max(300, 20 x the median step)."
            )
        if self.report_interval is None and self.report_every_s is None:
            raise ValueError("Pass report_interval (a Time, like '500ba') or report_every_s (seconds), or both.")
        check_data_and_scaling(self)  # ray/spec_checks.py: each option's value, and combinations of them
        from raytrain_events.ray.checkpointing.validation import check_validation, parse_validation

        self.validation = parse_validation(self.validation)
        check_validation(
            self.validation, self.checkpoint, self.eval_names if isinstance(self.datasets, Mapping) else None
        )
        if self.checkpoint is not None:
            if getattr(self.checkpoint, "save_folder", None):
                raise ValueError(
                    "CheckpointConfig.save_folder cannot be set for a RayTrainer run: checkpoints live in the run "
                    "directory (<storage_path>/<run_name>/checkpoints) so Ray Train can manage them. "
                    "Set storage_path instead."
                )
            from raytrain_events.checkpoint.folder.retention import check_ray_ranking

            check_ray_ranking(self.checkpoint)
            # The driver holds the run dir's lock for the whole run, and announces a changed config once
            # (ray/reports/console.announce_config_change); workers must not do either again.
            self.checkpoint = dataclasses.replace(self.checkpoint, lock_run_dir=False, announce_config_change=False)
        from raytrain_events.storage.exp_dir import check_run_name, fresh_run_name
        from raytrain_events.storage.fs import check_storage_url

        check_storage_url(self.storage_path or "runs")
        self.storage_path = storage_root(self.storage_path)
        self.storage_options = dict(self.storage_options or {})
        # No name: a fresh unique one, so two jobs never share a run directory (`default_run_name`).
        self.default_run_name = self.run_name is None
        self.run_name = fresh_run_name() if self.run_name is None else check_run_name(self.run_name)
        self.driver_loggers = list(self.driver_loggers or ())
        if self.log_step not in ("sample", "batch", "token", "epoch"):
            raise ValueError(f"log_step={self.log_step!r}: use 'sample', 'batch', 'token' or 'epoch'.")
        check_run_options(self)  # reports, failures, storage, the mixture's stages (ray/spec_checks.py)

    # -- derived values ------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "RayTrainer") -> RunSpec:
        """``RunSpec(**options)``, with unknown names reported against the known options."""
        check_option_names(options, where)
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in options]
        if options.get("max_duration") is None:  # optional in LoopOptions (eval-only Trainers), not here
            missing.append("max_duration")
        if missing:
            raise TypeError(
                f"{where} needs {', '.join(missing)} (e.g. model=..., optimizers=..., "
                "datasets={'train': ds}, max_duration='2ep')."
            )
        return cls(**options)

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` applied (``dataclasses.replace``: validated like a new spec)."""
        check_option_names(changes, "RunSpec.replace()")
        return dataclasses.replace(self, **changes)

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree of ``parallelism`` (1: none): the ranks that share each batch."""
        return self.parallelism_spec.tensor_parallel

    @property
    def workers(self) -> Any:
        """The number of Ray Train workers (from ``scaling_config`` when given)."""
        if self.scaling_config is None:
            return 1 if self.num_workers is None else self.num_workers
        if isinstance(self.scaling_config, Mapping):
            return self.scaling_config.get("num_workers", 1)
        return self.scaling_config.num_workers

    @property
    def eval_names(self) -> List[str]:
        """The eval datasets' names: every dataset but ``"train"``."""
        if not isinstance(self.datasets, Mapping):
            return []
        sources = set(self.mixture["sources"]) if self.mixture is not None else set()
        return sorted(k for k in self.datasets if k != "train" and k not in sources)

    @property
    def run_url(self) -> str:
        """Where this run's files live: ``<storage_path>/<run_name>``."""
        from raytrain_events.storage.fs import join

        return join(self.storage_path, self.run_name)

    def ray_scaling_config(self) -> Any:
        """The ``ray.train.ScalingConfig`` for this run."""
        from ray.train import ScalingConfig

        if self.scaling_config is None:
            return ScalingConfig(
                num_workers=self.workers, use_gpu=self.use_gpu, resources_per_worker=self.resources_per_worker
            )
        if isinstance(self.scaling_config, Mapping):
            return ScalingConfig(**self.scaling_config)
        return self.scaling_config

    def for_workers(self, datasets: Optional[Mapping[str, Any]] = None, **changes: Any) -> RunSpec:
        """The spec shipped to the workers: driver-only options at their defaults, datasets by name only.

        ``datasets`` is the resolved datasets dict when ``self.datasets`` is a factory.
        """
        driver_only = {
            f.name: _default(f) for f in dataclasses.fields(self) if not f.metadata["worker"] and f.name != "datasets"
        }
        source = datasets if datasets is not None else self.datasets
        names = {name: None for name in source} if isinstance(source, Mapping) else {"train": None}
        return dataclasses.replace(self, **driver_only, **changes, datasets=names)

    def describe(self) -> Dict[str, Any]:
        """The run's plain-data description (every option), saved as the run dir's config.yaml."""
        from raytrain_events.core.plain import describe_value

        out = {f.name: describe_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["num_workers"] = self.workers
        return out

    # -- what the worker builds -------------------------------------------------------------------
    def build_model(self) -> Any:
        """Call the model factory (with ``config`` if it takes an argument)."""
        return call_factory(self.model, self.config)

    def build_optimizers(self, model: Any) -> Any:
        """Call the optimizer factory with the model (and ``config`` if it takes it)."""
        return call_factory(self.optimizers, model, self.config)

    def build_schedulers(self, optimizers: Any) -> Any:
        """Call the scheduler factory with the optimizers, or pass a ready list through."""
        if self.schedulers is None:
            return None
        if callable(self.schedulers) and not _is_state_schedule(self.schedulers):
            return call_factory(self.schedulers, optimizers, self.config)
        return self.schedulers

    def build_list(self, what: Union[Sequence[Any], Factory]) -> List[Any]:
        """Algorithms or callbacks: a factory's result, or a list (built by name if plain data)."""
        items = call_factory(what, self.config) if callable(what) else list(what)
        return list(items)

    def build_datasets(self) -> Dict[str, Any]:
        """The datasets dict (calling a datasets factory with ``config``), checked for a ``"train"`` entry."""
        if not callable(self.datasets):
            return dict(self.datasets)
        datasets = call_factory(self.datasets, self.config)
        if not isinstance(datasets, Mapping) or ("train" not in datasets and self.mixture is None):
            raise ValueError(
                f"The datasets factory returned {datasets!r}: it must return {{'train': ds, <eval name>: ds, ...}}."
            )
        return dict(datasets)

    @staticmethod
    def check_datasets(datasets: Mapping[str, Any]) -> None:
        """Refuse a resolved datasets dict whose entries Ray Train cannot feed, naming the fix.

        The train set is a Ray Dataset or a seekable source (`parquet_seek.is_seekable`:
        ``ParquetRowGroups(paths)``, which a resumed epoch enters at its position); an eval set is
        a Ray Dataset (or Ray Train's zero-argument function returning one). Called on the driver
        once the datasets are built, before any worker starts.
        """
        from ray.data import Dataset

        from raytrain_events.data.ray.parquet_seek import is_seekable

        for name, dataset in datasets.items():
            kind = type(dataset).__name__
            if name == "train":
                if not isinstance(dataset, Dataset) and not is_seekable(dataset):
                    raise TypeError(
                        f"datasets['train'] is a {kind}; the train set must be a ray.data.Dataset (e.g. "
                        "ray.data.read_parquet(paths)) or a seekable source, "
                        "raytrain_events.data.ray.parquet_seek.ParquetRowGroups(paths) (Parquet files in training "
                        "order; a resume then reads nothing before its position)."
                    )
            elif is_seekable(dataset):
                raise TypeError(
                    f"datasets[{name!r}] is a {kind}, a train-only source (it defines the train order a resume "
                    f"seeks in); pass eval set {name!r} as a Ray Dataset, e.g. ray.data.read_parquet(paths)."
                )
            elif not isinstance(dataset, Dataset) and not callable(dataset):
                raise TypeError(
                    f"datasets[{name!r}] is a {kind}; an eval set must be a ray.data.Dataset (e.g. "
                    "ray.data.read_parquet(paths) or ray.data.from_items(rows))."
                )


def option_names() -> List[str]:
    """Every `RunSpec` option (= every `RayTrainer` keyword argument), in declaration order."""
    return [f.name for f in dataclasses.fields(RunSpec)]


# Options renamed, old spelling -> new: the old one fails with a TypeError naming the new one.
RENAMED_OPTIONS = {
    # `Trainer(loggers=...)` feeds the rank-0 loop; a Ray run's loggers are fed on the driver.
    "loggers": "driver_loggers",
}


def check_option_names(names: Any, where: str) -> None:
    """Raise a TypeError naming any of ``names`` that is not a `RunSpec` option (and a renamed one's new name)."""
    renamed = [n for n in names if n in RENAMED_OPTIONS]
    if renamed:
        raise TypeError(
            "; ".join(
                f"{where} got {old!r}, which was renamed {RENAMED_OPTIONS[old]!r}: pass {RENAMED_OPTIONS[old]}=[...] "
                "(logger destinations fed on the driver with metrics reduced across ranks)"
                for old in renamed
            )
            + "."
        )
    refuse_unknown(
        names,
        option_names(),
        f"{where} got {{names}}, which is not a RayTrainer argument; the arguments (RunSpec fields)",
    )


def _checked_init(init: Callable[..., None]) -> Callable[..., None]:
    """`RunSpec`'s generated ``__init__`` behind `check_option_names`: a renamed or unknown option's
    TypeError names the fix, where the dataclass would only say "unexpected keyword argument"."""

    @functools.wraps(init)
    def __init__(self: RunSpec, **options: Any) -> None:
        check_option_names(options, "RunSpec")
        init(self, **options)

    return __init__


RunSpec.__init__ = _checked_init(RunSpec.__init__)  # type: ignore[method-assign]


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


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


def _is_state_schedule(obj: Any) -> bool:
    # Composer-style schedules (fn(state) -> multiplier) are objects with this marker.
    return getattr(obj, "is_state_schedule", False)


_CONFIG_NAMES = ("config", "cfg")


def call_factory(fn: Factory, *args: Any) -> Any:
    """Call ``fn`` with as many leading ``args`` as it takes (the last of ``args`` is the run's config).

    A parameter with a default (``lambda model, lr=0.1: ...``) is left to its default unless it is
    named ``config`` or ``cfg``: the config dict must not arrive as ``lr``.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn(*args)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return fn(*args)
    count = 0
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or count == len(args):
            break
        if p.default is not p.empty and p.name not in _CONFIG_NAMES:
            break
        count += 1
    named = [p.name for p in params[count:] if p.name in _CONFIG_NAMES and p.kind is not p.POSITIONAL_ONLY]
    if args and count < len(args) and named:
        return fn(*args[:count], **{named[0]: args[-1]})
    return fn(*args[:count])
