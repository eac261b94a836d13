"""`RunSpec`: the one definition of a `RayTrainer` run's options.

Every option of a Ray run is a field, with its default and its meaning (``help``): the loop's
options are inherited from `raytrain_events.trainer.options.LoopOptions` (the one definition
`Trainer` uses too; the worker passes the spec to its `Trainer` as those options), the factories
(model, optimizers, schedulers, algorithms, callbacks) are `RunSpec`'s own fields, and the
run-level options are filed into sections (`raytrain_events.ray.spec_sections`): ``spec.data``,
``spec.scaling``, ``spec.storage``, ``spec.checkpoints``, ``spec.reports``, ``spec.failures``.
`RayTrainer(**options)` builds a `RunSpec` from the flat options (its keyword arguments are
exactly `option_names`); each section is built once, with its final values, and the spec is
frozen. `RunSpec.describe` is the run's config.yaml, a Tune trial's overrides are
`RunSpec.replace` (checked again like a new spec), and the worker builds its `Trainer` from the
spec in one function (`raytrain_events.ray.worker.build_worker_trainer`).
Adding a Ray option = one field in its section + the place that uses it (a loop option: a
`LoopOptions` field).

Models, optimizers and schedulers travel as factories (functions called on the worker), so a
large model is never pickled on the driver and each worker builds its own on its own device.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from raytrain_events.core.plain import describe_value
from raytrain_events.core.time_value import check_countable
from raytrain_events.data.ray.parquet_seek import is_seekable
from raytrain_events.data.ray.token_files import refuse_token_rows
from raytrain_events.ray.async_validation import check_validation
from raytrain_events.ray.spec_checks import check_data_and_scaling, check_run_options
from raytrain_events.ray.spec_sections import (
    CheckpointOptions,
    DataOptions,
    FailureOptions,
    ReportOptions,
    ScalingOptions,
    StorageOptions,
    storage_root,
)
from raytrain_events.ray.spec_sections import option_fields as section_fields
from raytrain_events.trainer.options import LoopOptions, option, refuse_unknown

__all__ = ["RunSpec", "option_names", "storage_root"]

Factory = Callable[..., Any]


_opt = option  # a RunSpec field: `LoopOptions`' own field helper (help, and worker=False for driver-only)


def _section(cls: type) -> Any:
    """A `RunSpec` field holding one section (ray/spec_sections.py) of the run's options."""
    return field(metadata={"section": cls})


@dataclass(frozen=True, kw_only=True)
class RunSpec(LoopOptions):
    """Everything a `RayTrainer` run needs: the loop's options and the factories as fields, the run-level
    options in sections (``spec.data.batch_size``, ``spec.storage.run_name``); each option (`option_names`)
    is also a `RayTrainer` keyword argument, flat.

    The loop's options (``max_duration``, ``eval_interval``, ``grad_accum``, ``precision``,
    ``parallelism``, ``compile``, ``seed``, ``config``) are the inherited `LoopOptions` fields: the
    same names, defaults and checks as `Trainer`'s, and the worker hands this spec to its `Trainer`
    as its ``options``. ``max_duration`` is required here (a Ray run always trains).

    Validated on construction (and on every `replace`), so bad input fails on the driver with a
    message naming the option, before any worker starts. Frozen: each value is made once, where the
    spec is built (the sections' ``of``, `LoopOptions`' check); a changed run is a new spec (`replace`).
    """

    # -- what to train: factories called on each worker --------------------------------------
    model: Factory = _opt(help="model(config) -> nn.Module, called on each worker (config may be omitted)")
    optimizers: Factory = _opt(help="optimizers(model, config) -> optimizer(s), called on each worker")
    schedulers: Optional[Any] = _opt(None, help="schedulers(optimizers, config) -> scheduler(s), or ready schedules")
    algorithms: Union[Sequence[Any], Factory] = _opt(
        (), help="algorithm instances or specs ('label_smoothing', {'name': 'mixup', 'alpha': 0.2}), or a factory"
    )
    callbacks: Union[Sequence[Any], Factory] = _opt((), help="callback instances, or callbacks(config) -> list")
    # -- the run-level options, by section (ray/spec_sections.py) ------------------------------------
    data: DataOptions = _section(DataOptions)
    scaling: ScalingOptions = _section(ScalingOptions)
    storage: StorageOptions = _section(StorageOptions)
    checkpoints: CheckpointOptions = _section(CheckpointOptions)
    reports: ReportOptions = _section(ReportOptions)
    failures: FailureOptions = _section(FailureOptions)

    def __post_init__(self) -> None:
        # The loop options, checked once here (LoopOptions); the driver's progress bar and the workers'
        # Trainer receive the typed values (max_duration a Time). The sections' values were made final by
        # their `of` (`RunSpec.__init__`); what follows only checks.
        super().__post_init__()
        if self.max_duration is None:
            raise TypeError("RayTrainer needs max_duration (e.g. max_duration='2ep').")
        data, failures = self.data, self.failures
        check_countable(self.max_duration, counts_tokens=data.get_num_tokens_in_batch is not None, what="max_duration")
        for name, options in (data.eval_options or {}).items():
            unknown = sorted(set(options) - {"eval_interval", "subset_num_batches", "metric_names"})
            if unknown:
                raise ValueError(
                    f"eval_options[{name!r}] has unknown keys {unknown}: use eval_interval, subset_num_batches, "
                    "metric_names."
                )
        if failures.hang_timeout is not None and (
            not isinstance(failures.hang_timeout, (int, float))
            or isinstance(failures.hang_timeout, bool)
            or failures.hang_timeout <= 0
        ):
            raise ValueError(
                f"hang_timeout={failures.hang_timeout!r} must be a positive number of seconds, or None for "
                "max(300, 20 x the median step)."
            )
        if self.reports.report_interval is None and self.reports.report_every_s is None:
            raise ValueError("Pass report_interval (a Time, like '500ba') or report_every_s (seconds), or both.")
        check_data_and_scaling(self)  # ray/spec_checks.py: each option's value, and combinations of them
        check_validation(
            self.checkpoints.validation,
            self.checkpoints.checkpoint,
            data.eval_names if isinstance(data.datasets, Mapping) else None,
        )
        if self.reports.log_step not in ("sample", "batch", "token", "epoch"):
            raise ValueError(f"log_step={self.reports.log_step!r}: use 'sample', 'batch', 'token' or 'epoch'.")
        check_run_options(self)  # reports, failures, storage, the mixture's stages (ray/spec_checks.py)

    # -- building and copying -------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "RayTrainer") -> RunSpec:
        """``RunSpec(**options)``, with unknown names reported against the known options."""
        check_option_names(options, where)
        missing = [f.name for f in option_fields() if _required(f) and f.name not in options]
        if options.get("max_duration") is None:  # optional in LoopOptions (eval-only Trainers), not here
            missing.append("max_duration")
        if missing:
            raise TypeError(
                f"{where} needs {', '.join(missing)} (e.g. model=..., optimizers=..., "
                "datasets={'train': ds}, max_duration='2ep')."
            )
        return cls(**options)

    def options(self) -> Dict[str, Any]:
        """Every option's value, flat (the `RayTrainer` keywords), in `option_names` order."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            section = f.metadata.get("section")
            if section is None:
                out[f.name] = getattr(self, f.name)
            else:
                part = getattr(self, f.name)
                out.update((g.name, getattr(part, g.name)) for g in section_fields(section))
        return out

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` (flat option names) applied (``dataclasses.replace``: checked like a new
        spec); a section none of whose options change is kept as it is (`_resolve`)."""
        check_option_names(changes, "RunSpec.replace()")
        return dataclasses.replace(self, **changes)

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree of ``parallelism`` (1: none): the ranks that share each batch."""
        return self.parallelism_spec.tensor_parallel

    def for_workers(self, datasets: Optional[Mapping[str, Any]] = None, **changes: Any) -> RunSpec:
        """The spec shipped to the workers: driver-only options at their defaults, datasets by name only.

        ``datasets`` is the resolved datasets dict when ``self.data.datasets`` is a factory.
        """
        driver_only = {
            f.name: _default(f) for f in option_fields() if not f.metadata["worker"] and f.name != "datasets"
        }
        source = datasets if datasets is not None else self.data.datasets
        names = {name: None for name in source} if isinstance(source, Mapping) else {"train": None}
        return self.replace(**{**driver_only, **changes, "datasets": names})

    def describe(self) -> Dict[str, Any]:
        """The run's plain-data description (every option), saved as the run dir's config.yaml."""

        out = {name: describe_value(value) for name, value in self.options().items()}
        out["num_workers"] = self.scaling.workers
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
        if not callable(self.data.datasets):
            return dict(self.data.datasets)
        datasets = call_factory(self.data.datasets, self.config)
        if not isinstance(datasets, Mapping) or ("train" not in datasets and self.data.mixture is None):
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
                refuse_token_rows(dataset)  # token files as plain rows (a footer's layout key)
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
            else:
                refuse_token_rows(dataset, name)  # an eval set of token files read as plain rows too


def option_fields() -> List[dataclasses.Field]:
    """Every `RunSpec` option's field: the loop's and the factories (`RunSpec`'s own), then each section's."""
    out: List[dataclasses.Field] = []
    for f in dataclasses.fields(RunSpec):
        section = f.metadata.get("section")
        out.extend(section_fields(section) if section is not None else [f])
    return out


def option_names() -> List[str]:
    """Every `RunSpec` option (= every `RayTrainer` keyword argument), in declaration order."""
    return [f.name for f in option_fields()]


def _resolve(options: Mapping[str, Any]) -> Dict[str, Any]:
    """The dataclass fields of a spec for ``options``: flat options, and (from ``dataclasses.replace`` or
    `RunSpec.replace`) whole sections. Each section is built once by its ``of`` from its flat options,
    over the given section's values when there is one; a given section none of whose options change is
    kept as it is (its final values stay: a fresh run name, ``default_run_name``)."""
    fields: Dict[str, Any] = {}
    for f in dataclasses.fields(RunSpec):
        section = f.metadata.get("section")
        if section is None:
            if f.name in options:
                fields[f.name] = options[f.name]
            continue
        names = [g.name for g in section_fields(section)]
        mine = {n: options[n] for n in names if n in options}
        given = options.get(f.name)
        if given is not None and not isinstance(given, section):
            raise TypeError(f"RunSpec({f.name}=...) takes a {section.__name__}, got {type(given).__name__}.")
        if given is None:
            fields[f.name] = section.of(**mine)
        elif mine:
            fields[f.name] = section.of(**{**{n: getattr(given, n) for n in names}, **mine})
        else:
            fields[f.name] = given
    return fields


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
    """`RunSpec`'s generated ``__init__`` behind `check_option_names` (a renamed or unknown option's
    TypeError names the fix, where the dataclass would only say "unexpected keyword argument") and
    `_resolve` (the flat options filed into their sections)."""

    @functools.wraps(init)
    def __init__(self: RunSpec, **options: Any) -> None:
        check_option_names([n for n in options if n not in _SECTION_NAMES], "RunSpec")
        init(self, **_resolve(options))

    return __init__


# The generated ``__init__`` takes the sections; `RunSpec(**options)` takes the flat options (the
# `RayTrainer` keywords) and builds each section once (`_resolve`) before it.
_SECTION_NAMES = frozenset(f.name for f in dataclasses.fields(RunSpec) if "section" in f.metadata)
RunSpec.__init__ = _checked_init(RunSpec.__init__)  # type: ignore[method-assign]


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


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
