"""`sweep()`: a Ray Tune sweep whose trials each train with `RayTrainer` (see `raytrain_events.tune`).

The sweep runs in four steps, one function each: `_validate` the arguments (nothing starts on a
bad one), `_prepare` the experiment folder (new, or an interrupted sweep to resume), `_run` the
Tuner, and `_collect` its results into a `SweepResult`. What the sweep asks of Tune (the search space,
metric, scheduler, limits) is one value, `_Search`, built once from `sweep`'s arguments.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from raytrain_events.ray import _compat, cluster
from raytrain_events.ray.reports.console import quiet_terminal
from raytrain_events.ray.spec import RunSpec, storage_root
from raytrain_events.storage.exp_dir import check_run_name
from raytrain_events.storage.fs import join, resolve
from raytrain_events.storage.run_dir import SWEEP_FILE
from raytrain_events.tune.console import SweepConsole
from raytrain_events.tune.mixture_pbt import check_mixture_pbt
from raytrain_events.tune.mixture_searcher import MixtureSearcher
from raytrain_events.tune.pbt_end import EndAwarePBT
from raytrain_events.tune.placement import ReleaseTrainWorkers, release_placement_groups, start_registry
from raytrain_events.tune.results import TIME_ATTRS, SweepResult, is_finite_number, make_result
from raytrain_events.tune.sets import space_choices, validate_set
from raytrain_events.tune.simplex import base_mixture, check_mixture_choice
from raytrain_events.tune.sweep_checks import check_sweep
from raytrain_events.tune.trial import (
    TrialSetup,
    base_spec,
    check_trainer_keys,
    raytrain_trial,
    trial_dirname,
    write_record,
)

__all__ = ["sweep"]

logger = logging.getLogger(__name__)


def sweep(
    *,
    trainer: Any,
    param_space: Optional[Mapping[str, Any]] = None,
    metric: str,
    mode: str,
    num_samples: int = 1,
    max_concurrent_trials: Optional[int] = None,
    scheduler: Any = None,
    search_alg: Any = None,
    storage_path: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    name: Optional[str] = None,
    resume: bool = True,
    trial_resources: Optional[Dict[str, float]] = None,
    trial_max_failures: int = 0,
    callbacks: Sequence[Any] = (),
    verbose: int = 1,
) -> SweepResult:
    """Run a Ray Tune sweep whose trials each train with `RayTrainer`; return a `SweepResult`.

    Args:
        trainer: `RayTrainer` keyword arguments (or a `RunSpec`) shared by all trials (``model``,
            ``optimizers``, ``datasets``, ``max_duration``, ``batch_size``, ``num_workers``, ``checkpoint``, ...).
            ``datasets`` may also be a factory ``fn(config) -> {"train": ds, ...}`` called in each trial.
            ``storage_path``/``storage_options``/``run_name`` are set by the sweep.
        param_space: Tune search space. ``"algorithms"`` holds algorithm sets (see
            `algorithm_sets_grid`); ``"mixture"`` holds mixture weights (`mixture_space`,
            `mixture_grid`) for ``trainer["mixture"]``'s first stage; ``"trainer"`` holds `RayTrainer` overrides; every key reaches
            the factories' ``config``.
        metric, mode: what to optimize (``"metrics/eval/accuracy"``/``"max"``, ``"train/loss"``/``"min"``);
            a trial's value is the last one it reported.
        num_samples: Tune's ``num_samples`` (repeats of the grid, or samples of random domains).
        max_concurrent_trials: trials at once; default: as many as the cluster's resources hold
            worker groups of ``trainer``'s scaling config (a trial itself takes ``{"cpu": 0.01}``).
        scheduler: any Tune scheduler, e.g. ``ASHAScheduler(time_attr="time/sample", max_t=...)``;
            leave its metric/mode unset (the sweep's are used). With ASHA prefer
            ``stop_last_trials=False`` or ``max_t`` above the trial duration, so trials reaching it
            end on their own (with their final report and checkpoint) instead of being stopped.
        search_alg: an optional Tune search algorithm.
        storage_path, storage_options: where the sweep lives (local path or fsspec URL; default ``./runs``).
        name: the sweep's folder name; default ``sweep-<time>``. Give one to make a sweep resumable.
        resume: continue an interrupted sweep with this ``storage_path``/``name``; with
            ``resume=False`` an existing one is an error.
        trial_resources: resources of the Tune trial itself (default ``{"cpu": 0.01}``).
        trial_max_failures: Tune retries per trial (the trainer's own ``max_failures`` retries
            inside Train).
        callbacks: extra Tune callbacks.
        verbose: 0: quiet; 1: one line per trial event and the final table sorted by the metric
            (`SweepConsole`, Ray's internal lines kept in its log files); 2-3: Tune's own reporter
            and every Ray line.
    """
    search = _Search(
        param_space=dict(param_space or {}),
        metric=metric,
        mode=mode,
        num_samples=num_samples,
        max_concurrent_trials=max_concurrent_trials,
        scheduler=scheduler,
        search_alg=search_alg,
        trial_resources=dict(trial_resources or {"cpu": 0.01}),
        trial_max_failures=trial_max_failures,
        callbacks=tuple(callbacks),
        verbose=verbose,
    )
    base = _validate(trainer, search, name, storage_path)
    cluster.ensure_ray()  # read through the module: tests stand in a refusing start
    experiment = _prepare(storage_path, storage_options, name, resume)
    result = _collect(_run(base, experiment, search), base, experiment, search)
    if verbose == 1:
        print("\n" + result.to_table(), flush=True)  # the user's console output, like SweepConsole's lines
    return result


@dataclass(frozen=True)
class _Search:
    """What the sweep asks of Tune (`sweep`'s arguments of that name, as given): built once, read by `_validate`,
    `_tuner` and `_collect`. ``max_concurrent_trials`` None: as many as the cluster holds (`_concurrency`)."""

    param_space: Dict[str, Any]
    metric: str
    mode: str
    num_samples: int
    max_concurrent_trials: Optional[int]
    scheduler: Any
    search_alg: Any
    trial_resources: Dict[str, float]
    trial_max_failures: int
    callbacks: Tuple[Any, ...]
    verbose: int

    @property
    def is_pbt(self) -> bool:
        return _is_pbt(self.scheduler)


@dataclass
class _Experiment:
    """Where a sweep lives: our URL for it, and Tune's path and filesystem for the same folder."""

    name: str
    url: str
    storage_options: Dict[str, Any]
    tune_storage: str
    tune_fs: Any
    restoring: bool

    @property
    def tune_path(self) -> str:
        return self.tune_storage.rstrip("/") + "/" + self.name


def _validate(trainer: Any, search: _Search, name: Optional[str], storage_path: Optional[str]) -> RunSpec:
    """Check every argument before anything starts (Ray included); return the trials' base `RunSpec`."""

    metric, mode, num_samples, concurrent = search.metric, search.mode, search.num_samples, search.max_concurrent_trials
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'.")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r} must be the name of a reported metric, like 'metrics/eval/accuracy'.")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be an integer >= 1.")
    if concurrent is not None and (not isinstance(concurrent, int) or concurrent < 1):
        raise ValueError(f"max_concurrent_trials={concurrent!r} must be an integer >= 1 (or None).")
    base = base_spec(trainer)
    _check_param_space(base, search)
    _check_mixture_searcher(base, search.param_space, mode, search.search_alg)
    if name is not None:  # the sweep's folder: one name inside storage_path (as a run's)
        check_run_name(name, "name")
    check_sweep(base, search.param_space, metric, storage_path, search.is_pbt)
    return base


def _check_param_space(base: RunSpec, search: _Search) -> None:
    """The search space's algorithm sets, mixture and trainer overrides, and the scheduler's time axis."""
    param_space, scheduler = search.param_space, search.scheduler
    if "algorithms" in param_space:
        for choice in space_choices(param_space["algorithms"]):
            validate_set(choice)
    _check_mixture_search(base, param_space, scheduler)
    overrides = param_space.get("trainer")
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise TypeError(f"param_space['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
        check_trainer_keys(list(overrides), "param_space['trainer']")
    time_attr = _compat.scheduler_time_attr(scheduler)
    if time_attr is not None and time_attr.startswith("time/") and time_attr not in TIME_ATTRS:
        raise ValueError(f"scheduler time_attr={time_attr!r} is not reported; use one of {', '.join(TIME_ATTRS)}.")
    if time_attr == "time/token" and base.data.get_num_tokens_in_batch is None:
        raise ValueError(
            "scheduler time_attr='time/token' needs trainer['get_num_tokens_in_batch'] (else tokens stay 0)."
        )


def _check_mixture_search(base: RunSpec, param_space: Mapping[str, Any], scheduler: Any) -> None:
    """A searched mixture, and PBT over it, refused before Ray starts if the base run cannot train them."""
    explores = getattr(scheduler, "raytrain_mixture_explore", None) is not None  # pbt_scheduler(mixture=...)
    if "mixture" not in param_space and not explores:
        return
    if "mixture" in param_space:
        check_mixture_choice(base_mixture(base), param_space["mixture"])
    check_mixture_pbt(scheduler, param_space, base_mixture(base))


def _check_mixture_searcher(
    base: RunSpec, param_space: Optional[Mapping[str, Any]], mode: str, search_alg: Any
) -> None:
    """A `MixtureSearcher` (or a Tune wrapper of one) refused before Ray starts if the base run cannot train its trials."""
    searcher = search_alg
    while searcher is not None and not isinstance(searcher, MixtureSearcher):
        searcher = getattr(searcher, "searcher", None)  # ConcurrencyLimiter / Repeater wrap theirs
    if searcher is None:
        return
    if "mixture" in (param_space or {}):
        raise ValueError(
            "search_alg=MixtureSearcher places config['mixture'] itself, but param_space has a 'mixture' too: "
            "drop param_space['mixture'] (the searcher draws its first trials and places the rest)."
        )
    if mode != "min":
        raise ValueError(f"MixtureSearcher minimises a loss, but the sweep's mode is {mode!r}: use mode='min'.")
    mixture = base_mixture(base)
    check_mixture_choice(mixture, dict.fromkeys(searcher.names, 1.0))  # no base mixture, unknown names, amounts
    assert mixture is not None
    if sorted(searcher.names) != sorted(mixture.names):
        raise ValueError(
            f"MixtureSearcher is over sources {list(searcher.names)}, the sweep's mixture has {list(mixture.names)}: "
            "build it with MixtureSearcher(<the trainer's mixture>, ...)."
        )


def _prepare(
    storage_path: Optional[str], storage_options: Optional[Dict[str, Any]], name: Optional[str], resume: bool
) -> _Experiment:
    """Settle the sweep's folder: a new one, or an interrupted sweep Tune can restore."""
    from ray import tune

    # why here: defers torch.distributed.tensor (the Ray driver, algorithms load it) until a sweep needs it
    from raytrain_events.ray.driver import ray_storage

    options = dict(storage_options or {})
    root = storage_root(storage_path)
    name = name or datetime.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
    tune_storage, tune_fs = ray_storage(root, options)
    experiment = _Experiment(name, join(root, name), options, tune_storage, tune_fs, restoring=False)
    experiment.restoring = resume and tune.Tuner.can_restore(experiment.tune_path, storage_filesystem=tune_fs)
    if not experiment.restoring and _experiment_exists(experiment.url, options):
        if not resume:
            raise FileExistsError(
                f"{experiment.url} already exists: pass resume=True to continue that sweep, "
                "or choose another name (or storage_path)."
            )
        raise FileExistsError(
            f"{experiment.url} holds files but no sweep Tune can resume (no tuner.pkl/experiment "
            "state): choose another name (or storage_path), or remove that folder."
        )
    return experiment


def _run(base: RunSpec, experiment: _Experiment, search: _Search) -> Any:
    """Build (or restore) the Tuner and fit it; the trials' placement groups are released after."""
    import ray

    console = [SweepConsole(search.metric, search.mode, search.scheduler)] if search.verbose == 1 else []
    _write_sweep_settings(experiment, search.metric, search.mode)
    registry = start_registry(experiment.url)
    try:
        setup = TrialSetup(
            spec=base,
            experiment_url=experiment.url,
            storage_options=experiment.storage_options,
            registry=registry,
            metric=search.metric,
            mode=search.mode,
            keep_every_checkpoint=search.is_pbt,
        )
        holds = _cluster_holds(base)  # one look at the cluster's resources for both decisions
        concurrency = holds if search.max_concurrent_trials is None else search.max_concurrent_trials
        if isinstance(search.scheduler, EndAwarePBT):  # pauses no trial to make room when every trial has it
            search.scheduler.trials_at_once = min(concurrency, holds)
        tuner = _tuner(setup, experiment, search, concurrency=concurrency, console=console)
        try:
            with _lenient_metric_checking(), quiet_terminal(search.verbose >= 2):
                return tuner.fit()
        finally:
            release_placement_groups(ray.get(registry.pop_all.remote()))
    finally:
        ray.kill(registry)


def _tuner(setup: TrialSetup, experiment: _Experiment, search: _Search, *, concurrency: int, console: list) -> Any:
    """The sweep's Tuner: restored from its folder when ``experiment`` is an interrupted sweep (Tune keeps its search
    space, config and callbacks), else a new one over ``search``; each trial runs `raytrain_trial`."""
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    trainable = tune.with_resources(
        tune.with_parameters(raytrain_trial, sweep_setup=setup), dict(search.trial_resources)
    )
    if experiment.restoring:
        logger.info("Resuming the sweep in %s.", experiment.url)
        return tune.Tuner.restore(
            experiment.tune_path, trainable=trainable, resume_errored=True, storage_filesystem=experiment.tune_fs
        )
    return tune.Tuner(
        trainable,
        param_space=dict(search.param_space),
        tune_config=tune.TuneConfig(
            metric=search.metric,
            mode=search.mode,
            num_samples=search.num_samples,
            max_concurrent_trials=concurrency,
            scheduler=search.scheduler,
            search_alg=search.search_alg,
            trial_dirname_creator=trial_dirname,
            trial_name_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=experiment.name,
            storage_path=experiment.tune_storage,
            storage_filesystem=experiment.tune_fs,
            callbacks=[JsonLoggerCallback(), ReleaseTrainWorkers(experiment.url), *console, *search.callbacks],
            failure_config=tune.FailureConfig(max_failures=search.trial_max_failures),
            verbose=search.verbose if search.verbose >= 2 else 0,  # 1: our lines, not Tune's periodic tables
        ),
    )


@contextlib.contextmanager
def _lenient_metric_checking() -> Iterator[None]:
    """Let Tune accept results without the sweep's metric.

    Entries between evaluations lack eval metrics: they must still reach the scheduler and the
    history (schedulers skip results without the metric), so Tune must not reject them.
    """
    previous = os.environ.get("TUNE_DISABLE_STRICT_METRIC_CHECKING")
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TUNE_DISABLE_STRICT_METRIC_CHECKING", None)
        else:
            os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = previous


def _collect(result_grid: Any, base: RunSpec, experiment: _Experiment, search: _Search) -> SweepResult:
    """The `SweepResult` of a finished Tuner; fails if no trial reported the sweep's metric."""

    metric, scheduler = search.metric, search.scheduler
    time_attr = _compat.scheduler_time_attr(scheduler)
    result = make_result(
        result_grid,
        metric=metric,
        mode=search.mode,
        spec=base,
        experiment_url=experiment.url,
        storage_options=experiment.storage_options,
        time_attr=time_attr or "time/sample",
        max_t=_compat.scheduler_max_t(scheduler) if time_attr else None,
    )
    if result.best is None and result.rows and not result.errors:
        seen = sorted({k for h in result.histories.values() for e in h for k in e if is_finite_number(e.get(k))})
        raise ValueError(
            f"No trial reported metric {metric!r}; reported metrics: {', '.join(k for k in seen if '/' in k) or 'none'}. "
            f"The trials' results are kept in {experiment.url}."
        )
    return result


def _cluster_holds(base: RunSpec) -> int:
    """How many worker groups of ``base``'s scaling config the cluster's resources hold (at least 1): the trials
    at once unless ``max_concurrent_trials`` says otherwise."""
    import ray

    demand = dict(getattr(base.scaling.ray_scaling_config(), "total_resources", None) or {"CPU": 1.0})
    available = ray.cluster_resources()
    fits = [int(available.get(k, 0.0) // v) for k, v in demand.items() if v > 0]
    return max(1, min(fits) if fits else 1)


def _experiment_exists(experiment_url: str, storage_options: Dict[str, Any]) -> bool:
    fs, path = resolve(experiment_url, storage_options)
    try:
        return bool(fs.exists(path)) and bool(fs.ls(path))
    except FileNotFoundError:
        return False


def _write_sweep_settings(experiment: _Experiment, metric: str, mode: str) -> None:
    """``sweep.json``: the metric and mode, so ``raytrain-events report`` compares trials by them."""

    write_record(join(experiment.url, SWEEP_FILE), experiment.storage_options, {"metric": metric, "mode": mode})


def _is_pbt(scheduler: Any) -> bool:
    """Whether the scheduler copies trials' checkpoints into other trials (PBT, PB2)."""
    from ray.tune.schedulers import PopulationBasedTraining

    return isinstance(scheduler, PopulationBasedTraining)
