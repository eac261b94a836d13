"""Ray Tune sweeps over algorithm sets and hyperparameters, each trial a distributed `RayTrainer` run.

Example (three algorithm sets x two learning rates, ASHA on the global sample count)::

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from raytrain_events.tune import algorithm_sets_grid, sweep

    result = sweep(
        trainer=dict(model=make_model, optimizers=make_sgd, datasets={"train": train_ds, "eval": eval_ds},
                     max_duration="4ep", batch_size=32, num_workers=2),
        param_space={
            "algorithms": algorithm_sets_grid([[], ["label_smoothing"], [{"name": "mixup", "alpha": 0.2}]]),
            "lr": tune.grid_search([0.05, 0.2]),            # reaches the factories as config["lr"]
        },
        metric="metrics/eval/accuracy", mode="max",
        scheduler=ASHAScheduler(time_attr="time/sample", max_t=4 * n_rows, grace_period=n_rows),
        storage_path="runs", name="algorithm-sweep",     # same name again resumes an interrupted sweep
    )
    print(result.to_table())
    print(result.best_algorithms, result.best_checkpoint)

How it runs
-----------
Each Tune trial is a function trainable that takes almost no CPU (``{"cpu": 0.01}``) and runs
``RayTrainer(**trainer, config=trial_config).fit()``: Train V2 starts its own controller and
workers for the trial. Inside a Tune trial, the trainer's controller callback
(`raytrain_events.ray.history.AggregatingCallback`) puts every aggregated history entry on
Tune's result queue, so Tune sees the driver's global Timestamp (``time/epoch``,
``time/batch``, ``time/sample``, ``time/token``, summed over all ranks), ``train/loss`` reduced
over all ranks' batches, eval metrics over the whole eval set, ``world_size`` and
``checkpoint_path`` -- never rank 0's local values. Any of the ``time/*`` keys can be a
scheduler's ``time_attr``.

The trial config (a sample of ``param_space``) is merged over ``trainer["config"]`` and given
to the model/optimizer/scheduler/dataset factories. Two keys are special:

* ``"algorithms"``: a list of algorithm specs (``"label_smoothing"``,
  ``{"name": "mixup", "alpha": 0.2}``) that replaces ``trainer["algorithms"]`` for the trial.
  Use `algorithm_sets_grid` (a grid) or ``tune.choice(sets)`` (a categorical).
* ``"trainer"``: a dict of `RayTrainer` keyword overrides (``batch_size``, ``max_duration``,
  ``seed``, ``num_workers``, ...), which may hold Tune domains themselves.

Storage
-------
The sweep lives in ``<storage_path>/<name>/`` (Tune's experiment folder). Each trial's Train run
goes to ``<storage_path>/<name>/<trial folder>/train/`` (its checkpoints, with a
`raytrain_events.checkpoint.CheckpointConfig` in ``trainer["checkpoint"]``, under ``.../train/checkpoints``),
and a trial that finished writes ``<trial folder>/raytrain_trial.json`` with its history.

Stopped trials
--------------
When Tune stops a trial early (a scheduler's STOP), it terminates the trial's actor, and with it
the trial's Train controller and workers; the placement group Train reserved for the workers
outlives them (it belongs to the job), and Ray Train's own cleaner for it needs the dashboard's
state API. So every worker group registers its placement group with the sweep, and the sweep
removes a trial's groups a few seconds after the trial ended -- otherwise each stopped trial
would keep its workers' CPUs/GPUs and later trials could wait for them forever.

Resuming
--------
``sweep(..., resume=True)`` with the same ``storage_path`` and ``name`` restores the sweep
(``Tuner.restore(..., resume_errored=True)``): finished trials are not run again, unfinished and
errored ones are restarted (from their own newest checkpoint when ``CheckpointConfig(autoresume=True)``),
and trials never started run. Tune saves its experiment state at most every ~10 s, so a sweep killed
right after a trial finished may not know it finished; such a trial finds its
``raytrain_trial.json`` and replays its recorded history to Tune instead of training again.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence

from raytrain_events.ray.tune_placement import (
    _release_placement_groups,
    _ReleaseTrainWorkers,
    _start_registry,
    _trial_callbacks,
)
from raytrain_events.ray.tune_result import (
    TIME_ATTRS,
    TRIAL_RECORD,
    TRIAL_RUN_NAME,
    SweepResult,
    _finite,
    _make_result,
)
from raytrain_events.ray.tune_sets import (
    _algorithm_choices,
    _normalize_set,
    _validate_set,
    algorithm_set_label,
    algorithm_sets_grid,
)

__all__ = [
    "sweep",
    "SweepResult",
    "algorithm_sets_grid",
    "algorithm_set_label",
    "TIME_ATTRS",
    "TRIAL_RECORD",
    "TRIAL_RUN_NAME",
]

logger = logging.getLogger(__name__)


# RayTrainer arguments the sweep sets itself.
_SWEEP_OWNED = {
    "storage_path": "pass sweep(storage_path=...): each trial's run goes into its own folder under the sweep",
    "storage_options": "pass sweep(storage_options=...)",
    "run_name": "each trial's run is named by the sweep",
}


# ----------------------------------------------------------------------------------------------
# Algorithm sets
# ----------------------------------------------------------------------------------------------


@dataclass
class _TrialSetup:
    """What every trial needs from the sweep (shipped once through the object store)."""

    spec: Any  # the base RunSpec
    experiment_url: str
    storage_options: Dict[str, Any]
    registry: Any = None  # the sweep's _PlacementGroups actor
    metric: Optional[str] = None
    mode: str = "max"


# -- Releasing a stopped trial's Train workers ---------------------------------------------------
#
# Tune stops a trial (a scheduler's STOP, a stopper, a time budget) by terminating the trial's
# actor. Its Train controller, an actor the trial owns, dies with it, and Train's placement group
# for the workers -- scoped to the job, not to the controller -- stays reserved. Ray Train's own
# PlacementGroupCleaner releases it through the state API, which needs the dashboard and fails when
# several Ray instances run on one machine; then every stopped trial leaks its workers' CPUs/GPUs
# and later trials wait forever for resources. So rank 0 of every worker group registers its
# placement group with the sweep, and a Tune callback removes a finished trial's groups shortly
# after Tune stopped it (removing a group Train already removed is a no-op).


def _check_trainer_keys(keys: Sequence[str], where: str) -> None:
    from raytrain_events.ray.spec import check_option_names

    for key in keys:
        if key in _SWEEP_OWNED:
            raise ValueError(f"{where}[{key!r}] is set by the sweep: {_SWEEP_OWNED[key]}.")
    check_option_names(keys, where)


def _base_spec(trainer: Any) -> Any:
    """The `RunSpec` every trial starts from (validated now, so bad options fail before any trial)."""
    from raytrain_events.ray.spec import RunSpec

    if isinstance(trainer, RunSpec):
        return trainer
    if not isinstance(trainer, Mapping):
        raise TypeError(f"trainer must be a RunSpec or a dict of RayTrainer arguments, got {trainer!r}.")
    _check_trainer_keys(list(trainer), "trainer")
    return RunSpec.from_options(trainer, "sweep(trainer=...)")


def _trial_spec(base: Any, config: Mapping[str, Any]) -> Any:
    """One trial's `RunSpec`: ``base`` with the trial's overrides, algorithm set and config (``replace``)."""
    config = dict(config)
    overrides = config.get("trainer") or {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"config['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
    _check_trainer_keys(list(overrides), "param_space['trainer']")
    changes = dict(overrides)
    if "algorithms" in config:
        changes["algorithms"] = _normalize_set(config["algorithms"])
    changes["config"] = {**base.config, **config}
    changes["progress_bar"] = False
    return base.replace(**changes)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value  # json writes and reads NaN/inf
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return _jsonable(value.item())  # numpy scalars
    return repr(value)


def _read_record(url: str, storage_options: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    from raytrain_events.storage.fs import read_bytes, resolve

    fs, path = resolve(url, storage_options)
    try:
        return json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        return None
    except ValueError:  # a torn or foreign file: train again rather than trust it
        logger.warning("Ignoring unreadable trial record %s; the trial trains again.", url)
        return None


def _write_record(url: str, storage_options: Dict[str, Any], record: Dict[str, Any]) -> None:
    from raytrain_events.storage.fs import resolve, write_bytes_atomic

    fs, path = resolve(url, storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_bytes_atomic(fs, path, json.dumps(_jsonable(record), indent=1).encode())


def raytrain_trial(config: Dict[str, Any], sweep_setup: Optional[_TrialSetup] = None) -> None:
    """The Tune function trainable: one `RayTrainer` run (or a replay of a finished one)."""
    from ray import tune

    from raytrain_events.ray.driver import RayTrainer
    from raytrain_events.storage.fs import join

    setup = sweep_setup
    if setup is None:
        raise RuntimeError("raytrain_trial runs inside raytrain_events.tune.sweep(); call sweep() instead.")
    trial_folder = os.path.basename(tune.get_context().get_trial_dir().rstrip("/"))
    trial_url = join(setup.experiment_url, trial_folder)
    record_url = join(trial_url, TRIAL_RECORD)
    record = _read_record(record_url, setup.storage_options)
    if record is not None:
        # Finished before the sweep was interrupted, but Tune's saved state did not know yet.
        print(
            f"[raytrain_events.tune] {trial_folder} already finished ({record_url}): replaying its "
            f"{len(record['history'])} results instead of training again.",
            flush=True,
        )
        for entry in record["history"]:
            tune.report(dict(entry))
        return
    spec = _trial_spec(setup.spec, config)
    spec = _trial_retention_and_loggers(spec, config, trial_folder, setup)
    result = RayTrainer(
        spec,
        callbacks=functools.partial(
            _trial_callbacks, spec.callbacks, setup.registry, tune.get_context().get_trial_id()
        ),
        storage_path=trial_url,
        storage_options=setup.storage_options,
        run_name=TRIAL_RUN_NAME,
    ).fit()
    _write_record(
        record_url,
        setup.storage_options,
        {
            "run_url": result.run_url,
            "history": result.history,
            "checkpoints": [getattr(c, "url", str(c)) for c in result.checkpoints],
            "config": config,
        },
    )


def _trial_retention_and_loggers(spec: Any, config: Mapping[str, Any], trial_folder: str, setup: Any) -> Any:
    """A trial's spec whose checkpoints keep its best by the sweep's metric (never pruned) and whose
    loggers' runs are named after the trial and its algorithm set."""
    import dataclasses
    import re

    changes: Dict[str, Any] = {}
    checkpoint = spec.checkpoint
    if checkpoint is not None and checkpoint.keep is not None and (setup.metric or "").startswith("metrics/"):
        # keep=N would prune by age and could delete the sweep's best checkpoint: keep the N best
        # by the sweep's metric instead (Ray Train's manager also keeps the newest, for resuming).
        changes["checkpoint"] = dataclasses.replace(
            checkpoint,
            keep=None,
            only_save_most_recent=False,
            keep_best=checkpoint.keep,
            metric=setup.metric,
            mode=setup.mode,
        )
    if spec.loggers:
        from raytrain_events.ray.run_loggers import name_destination
        from raytrain_events.ray.sweep_console import trial_label

        name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"{trial_folder}-{trial_label(dict(config))}").strip("_")
        changes["loggers"] = [name_destination(d, name) for d in spec.loggers]
    return spec.replace(**changes) if changes else spec


def _trial_dirname(trial: Any) -> str:
    """Short, stable trial folder names (Tune's default embeds the whole config)."""
    return f"trial_{trial.trial_id}"


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


def _default_concurrency(scaling_config: Any) -> int:
    """How many trials' worker groups fit on the cluster at once (at least 1)."""
    import ray

    demand = dict(getattr(scaling_config, "total_resources", None) or {"CPU": 1.0})
    available = ray.cluster_resources()
    fits = [int(available.get(k, 0.0) // v) for k, v in demand.items() if v > 0]
    return max(1, min(fits) if fits else 1)


def _experiment_exists(experiment_url: str, storage_options: Dict[str, Any]) -> bool:
    from raytrain_events.storage.fs import resolve

    fs, path = resolve(experiment_url, storage_options)
    try:
        return bool(fs.exists(path)) and bool(fs.ls(path))
    except FileNotFoundError:
        return False


def _scheduler_time_attr(scheduler: Any) -> Optional[str]:
    return getattr(scheduler, "_time_attr", None) if scheduler is not None else None


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
        trainer: `RayTrainer` keyword arguments (or a `RunSpec`) shared by all trials (``model``, ``optimizers``,
            ``datasets``, ``max_duration``, ``batch_size``, ``num_workers``, ``checkpoint``, ...).
            ``datasets`` may also be a factory ``fn(config) -> {"train": ds, ...}`` called in each trial.
            ``storage_path``/``storage_options``/``run_name`` are set by the sweep.
        param_space: Tune search space. ``"algorithms"`` holds algorithm sets (see
            `algorithm_sets_grid`); ``"trainer"`` holds `RayTrainer` overrides; every key reaches
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
    import ray
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    from raytrain_events.ray.cluster import ensure_ray
    from raytrain_events.ray.driver import _ray_storage
    from raytrain_events.ray.spec import _storage_root
    from raytrain_events.storage.fs import join

    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'.")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r} must be the name of a reported metric, like 'metrics/eval/accuracy'.")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be an integer >= 1.")
    if max_concurrent_trials is not None and (not isinstance(max_concurrent_trials, int) or max_concurrent_trials < 1):
        raise ValueError(f"max_concurrent_trials={max_concurrent_trials!r} must be an integer >= 1 (or None).")
    base = _base_spec(trainer)
    param_space = dict(param_space or {})
    if "algorithms" in param_space:
        for choice in _algorithm_choices(param_space["algorithms"]):
            _validate_set(choice)
    overrides = param_space.get("trainer")
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise TypeError(f"param_space['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
        _check_trainer_keys(list(overrides), "param_space['trainer']")
    time_attr = _scheduler_time_attr(scheduler)
    if time_attr is not None and time_attr.startswith("time/") and time_attr not in TIME_ATTRS:
        raise ValueError(f"scheduler time_attr={time_attr!r} is not reported; use one of {', '.join(TIME_ATTRS)}.")
    if time_attr == "time/token" and base.get_num_tokens_in_batch is None:
        raise ValueError(
            "scheduler time_attr='time/token' needs trainer['get_num_tokens_in_batch'] (else tokens stay 0)."
        )

    ensure_ray()
    storage_options = dict(storage_options or {})
    root = _storage_root(storage_path)
    name = name or datetime.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
    experiment_url = join(root, name)
    tune_storage, tune_fs = _ray_storage(root, storage_options)
    experiment_path = tune_storage.rstrip("/") + "/" + name

    if max_concurrent_trials is None:
        max_concurrent_trials = _default_concurrency(base.ray_scaling_config())
    restoring = resume and tune.Tuner.can_restore(experiment_path, storage_filesystem=tune_fs)
    if not restoring and _experiment_exists(experiment_url, storage_options):
        if not resume:
            raise FileExistsError(
                f"{experiment_url} already exists: pass resume=True to continue that sweep, "
                "or choose another name (or storage_path)."
            )
        raise FileExistsError(
            f"{experiment_url} holds files but no sweep Tune can resume (no tuner.pkl/experiment "
            "state): choose another name (or storage_path), or remove that folder."
        )

    from raytrain_events.ray.console import quiet_terminal
    from raytrain_events.ray.sweep_console import SweepConsole

    console = [SweepConsole(metric, mode, scheduler)] if verbose == 1 else []
    _write_sweep_settings(experiment_url, storage_options, metric, mode)
    registry = _start_registry(experiment_url)
    try:
        setup = _TrialSetup(
            spec=base,
            experiment_url=experiment_url,
            storage_options=storage_options,
            registry=registry,
            metric=metric,
            mode=mode,
        )
        trainable = tune.with_resources(
            tune.with_parameters(raytrain_trial, sweep_setup=setup), dict(trial_resources or {"cpu": 0.01})
        )
        if restoring:
            logger.info("Resuming the sweep in %s.", experiment_url)
            tuner = tune.Tuner.restore(
                experiment_path, trainable=trainable, resume_errored=True, storage_filesystem=tune_fs
            )
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=metric,
                    mode=mode,
                    num_samples=num_samples,
                    max_concurrent_trials=max_concurrent_trials,
                    scheduler=scheduler,
                    search_alg=search_alg,
                    trial_dirname_creator=_trial_dirname,
                    trial_name_creator=_trial_dirname,
                ),
                run_config=tune.RunConfig(
                    name=name,
                    storage_path=tune_storage,
                    storage_filesystem=tune_fs,
                    callbacks=[JsonLoggerCallback(), _ReleaseTrainWorkers(experiment_url), *console, *callbacks],
                    failure_config=tune.FailureConfig(max_failures=trial_max_failures),
                    verbose=verbose if verbose >= 2 else 0,  # 1: our lines, not Tune's periodic tables
                ),
            )
        # Entries between evaluations lack eval metrics: they must still reach the scheduler and the
        # history (schedulers skip results without the metric), so Tune must not reject them.
        previous = os.environ.get("TUNE_DISABLE_STRICT_METRIC_CHECKING")
        os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
        try:
            with quiet_terminal(verbose >= 2):
                result_grid = tuner.fit()
        finally:
            if previous is None:
                os.environ.pop("TUNE_DISABLE_STRICT_METRIC_CHECKING", None)
            else:
                os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = previous
            _release_placement_groups(ray.get(registry.pop_all.remote()))
    finally:
        ray.kill(registry)

    result = _make_result(
        result_grid,
        metric=metric,
        mode=mode,
        spec=base,
        experiment_url=experiment_url,
        storage_options=storage_options,
        time_attr=time_attr or "time/sample",
        max_t=getattr(scheduler, "_max_t", None) if time_attr else None,
    )
    if result.best is None and result.rows and not result.errors:
        seen = sorted({k for h in result.histories.values() for e in h for k in e if _finite(e.get(k))})
        raise ValueError(
            f"No trial reported metric {metric!r}; reported metrics: {', '.join(k for k in seen if '/' in k) or 'none'}. "
            f"The trials' results are kept in {experiment_url}."
        )
    if verbose == 1:
        print("\n" + result.to_table(), flush=True)
    return result


def _write_sweep_settings(experiment_url: str, storage_options: Dict[str, Any], metric: str, mode: str) -> None:
    """``sweep.json``: the metric and mode, so ``raytrain-events report`` compares trials by them."""
    from raytrain_events.report import SWEEP_FILE
    from raytrain_events.storage.fs import join

    _write_record(join(experiment_url, SWEEP_FILE), storage_options, {"metric": metric, "mode": mode})
