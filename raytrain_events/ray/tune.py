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
import inspect
import json
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ray.tune import Callback

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

#: Global Timestamp keys in every reported entry; any of them can be a scheduler's ``time_attr``.
TIME_ATTRS = ("time/epoch", "time/batch", "time/sample", "time/token")
#: File a finished trial writes into its Tune trial folder (its history, checkpoints, run URL).
TRIAL_RECORD = "raytrain_trial.json"
#: The Train run name of every trial (the run folder inside the trial folder).
TRIAL_RUN_NAME = "train"

# RayTrainer arguments the sweep sets itself.
_SWEEP_OWNED = {
    "storage_path": "pass sweep(storage_path=...): each trial's run goes into its own folder under the sweep",
    "storage_options": "pass sweep(storage_options=...)",
    "run_name": "each trial's run is named by the sweep",
}
_UNIT_KEYS = {"ep": "time/epoch", "ba": "time/batch", "sp": "time/sample", "tok": "time/token"}


# ----------------------------------------------------------------------------------------------
# Algorithm sets
# ----------------------------------------------------------------------------------------------


def _normalize_set(algorithms: Any) -> List[Any]:
    """One algorithm set as a list of specs (``None`` and ``[]`` are the empty set)."""
    from raytrain_events.core.algorithm import Algorithm

    if algorithms is None:
        return []
    if isinstance(algorithms, (str, Mapping, Algorithm)):
        return [algorithms]
    if isinstance(algorithms, (list, tuple)):
        return list(algorithms)
    raise TypeError(
        f"An algorithm set must be a list of specs like ['label_smoothing', {{'name': 'mixup', 'alpha': 0.2}}], "
        f"got {type(algorithms).__name__} {algorithms!r}."
    )


def _spec_label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "name")
        return f"{spec.get('name')}({kwargs})" if kwargs else str(spec.get("name"))
    return type(spec).__name__


def algorithm_set_label(algorithms: Any) -> str:
    """A short readable name for an algorithm set: ``"label_smoothing+mixup(alpha=0.2)"``, ``"none"``."""
    specs = _normalize_set(algorithms)
    return "+".join(_spec_label(s) for s in specs) if specs else "none"


def _validate_set(algorithms: Any) -> List[Any]:
    """Build every spec once on the driver, so a typo fails before any trial starts."""
    from raytrain_events.algorithms.registry import build_algorithm

    specs = _normalize_set(algorithms)
    for spec in specs:
        if isinstance(spec, (list, tuple)):
            raise TypeError(
                f"An algorithm set holds a list ({spec!r}): to sweep over several sets, pass "
                "algorithm_sets_grid([set1, set2, ...]) or tune.choice([set1, set2, ...]) as param_space['algorithms']."
            )
        try:
            build_algorithm(spec)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Algorithm set {algorithm_set_label(specs)!r}: {exc}") from None
    return specs


def algorithm_sets_grid(sets: Sequence[Any], *, validate: bool = True) -> Dict[str, List[List[Any]]]:
    """``tune.grid_search`` over algorithm sets, for ``param_space["algorithms"]``.

    Each set is a list of specs (``[]`` for none, ``["label_smoothing"]``,
    ``[{"name": "mixup", "alpha": 0.2}, "label_smoothing"]``); a lone spec is a one-element set.
    With ``validate`` every spec is built once here, so unknown names or bad arguments fail now
    (listing the known algorithms), not inside a trial.
    """
    from ray import tune

    if isinstance(sets, (str, Mapping)) or not isinstance(sets, Sequence) or not sets:
        raise ValueError(f"algorithm_sets_grid needs a non-empty list of algorithm sets, got {sets!r}.")
    normalized = [_validate_set(s) if validate else _normalize_set(s) for s in sets]
    labels = [algorithm_set_label(s) for s in normalized]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"algorithm_sets_grid got the same set more than once: {duplicates}.")
    return tune.grid_search(normalized)


def _algorithm_choices(value: Any) -> List[Any]:
    """The algorithm sets a ``param_space["algorithms"]`` value can produce (for validation)."""
    from ray.tune.search.sample import Categorical, Domain

    if isinstance(value, Mapping) and set(value) == {"grid_search"}:
        return list(value["grid_search"])
    if isinstance(value, Categorical):
        return list(value.categories)
    if isinstance(value, Domain) or callable(value):
        return []  # sampled by a function: nothing to check up front
    return [value]


# ----------------------------------------------------------------------------------------------
# What each trial runs
# ----------------------------------------------------------------------------------------------


@dataclass
class _TrialSetup:
    """What every trial needs from the sweep (shipped once through the object store)."""

    trainer: Dict[str, Any]
    experiment_url: str
    storage_options: Dict[str, Any]
    registry: Any = None  # the sweep's _PlacementGroups actor


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


class _PlacementGroups:
    """Ray actor (one per sweep): the worker placement groups of each trial's Train runs."""

    def __init__(self) -> None:
        self.groups: Dict[str, List[Any]] = {}

    def add(self, trial_id: str, group: Any) -> None:
        groups = self.groups.setdefault(trial_id, [])
        if all(g.id != group.id for g in groups):
            groups.append(group)

    def pop(self, trial_id: str) -> List[Any]:
        return self.groups.pop(trial_id, [])

    def pop_all(self) -> List[Any]:
        groups = [g for gs in self.groups.values() for g in gs]
        self.groups.clear()
        return groups


def _registry_name(experiment_url: str) -> str:
    import hashlib

    return "raytrain_events.tune.placement_groups." + hashlib.sha1(experiment_url.encode()).hexdigest()[:16]


def _start_registry(experiment_url: str) -> Any:
    import ray

    actor = ray.remote(num_cpus=0)(_PlacementGroups)
    return actor.options(name=_registry_name(experiment_url), get_if_exists=True).remote()


def _register_placement_group(registry: Any, trial_id: str) -> None:
    """On a Train worker: rank 0 registers the worker group's placement group with the sweep."""
    import ray
    import ray.train

    if registry is None or ray.train.get_context().get_world_rank() != 0:
        return
    group = ray.util.get_current_placement_group()
    if group is not None:
        ray.get(registry.add.remote(trial_id, group), timeout=60)


def _trial_callbacks(user_callbacks: Any, registry: Any, trial_id: str, config: Dict[str, Any]) -> List[Any]:
    """The trainer's callbacks factory in a sweep: the user's callbacks, after registering the group."""
    from raytrain_events.ray.spec import _call

    _register_placement_group(registry, trial_id)
    return list(_call(user_callbacks, config) if callable(user_callbacks) else (user_callbacks or ()))


def _release_placement_groups(groups: Sequence[Any]) -> None:
    from ray.util import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # already removed, or the cluster is going away
            logger.debug("Could not remove placement group %s", getattr(group, "id", group), exc_info=True)


class _ReleaseTrainWorkers(Callback):
    """Tune callback: remove a finished trial's Train placement groups ``grace_s`` after it ended.

    The grace lets Tune terminate the trial actor first, so its Train run is not torn down under it.
    """

    def __init__(self, experiment_url: str, grace_s: float = 3.0) -> None:
        self.experiment_url = experiment_url
        self.grace_s = grace_s
        self.pending: List[Tuple[float, List[Any]]] = []

    def __getstate__(self) -> Dict[str, Any]:  # pickled into the sweep's tuner.pkl: nothing pending
        return {"experiment_url": self.experiment_url, "grace_s": self.grace_s, "pending": []}

    def _registry(self) -> Any:
        import ray

        try:
            return ray.get_actor(_registry_name(self.experiment_url))
        except ValueError:
            return None

    def _trial_ended(self, trial: Any) -> None:
        import time

        import ray

        registry = self._registry()
        if registry is not None:  # take the groups now: a retried trial registers new ones
            self.pending.append((time.monotonic(), ray.get(registry.pop.remote(trial.trial_id))))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_step_begin(self, iteration, trials, **info):
        import time

        if not self.pending:
            return
        now = time.monotonic()
        due = [groups for ended, groups in self.pending if now - ended >= self.grace_s]
        self.pending = [(ended, groups) for ended, groups in self.pending if now - ended < self.grace_s]
        for groups in due:
            _release_placement_groups(groups)

    def on_experiment_end(self, trials, **info):
        for _, groups in self.pending:
            _release_placement_groups(groups)
        self.pending = []


def _trainer_parameters() -> List[str]:
    from raytrain_events.ray.driver import RayTrainer

    return [p for p in inspect.signature(RayTrainer.__init__).parameters if p != "self"]


def _check_trainer_keys(keys: Sequence[str], where: str) -> None:
    allowed = _trainer_parameters()
    for key in keys:
        if key in _SWEEP_OWNED:
            raise ValueError(f"{where}[{key!r}] is set by the sweep: {_SWEEP_OWNED[key]}.")
        if key not in allowed:
            raise TypeError(f"{where} has {key!r}, which is not a RayTrainer argument; it accepts: {', '.join(allowed)}.")


def _trial_kwargs(trainer: Mapping[str, Any], config: Mapping[str, Any]) -> Dict[str, Any]:
    """`RayTrainer` kwargs for one trial: the base kwargs with the trial config merged in."""
    from raytrain_events.ray.spec import _call

    kwargs = dict(trainer)
    config = dict(config)
    overrides = config.get("trainer") or {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"config['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
    _check_trainer_keys(list(overrides), "param_space['trainer']")
    kwargs.update(overrides)
    if "algorithms" in config:
        kwargs["algorithms"] = _normalize_set(config["algorithms"])
    kwargs["config"] = {**dict(kwargs.get("config") or {}), **config}
    if callable(kwargs.get("datasets")):
        kwargs["datasets"] = _call(kwargs["datasets"], kwargs["config"])
    kwargs["progress_bar"] = False
    return kwargs


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
        print(f"[raytrain_events.tune] {trial_folder} already finished ({record_url}): replaying its "
              f"{len(record['history'])} results instead of training again.", flush=True)
        for entry in record["history"]:
            tune.report(dict(entry))
        return
    kwargs = _trial_kwargs(setup.trainer, config)
    kwargs["callbacks"] = functools.partial(
        _trial_callbacks, kwargs.get("callbacks"), setup.registry, tune.get_context().get_trial_id()
    )
    result = RayTrainer(
        **kwargs, storage_path=trial_url, storage_options=setup.storage_options, run_name=TRIAL_RUN_NAME
    ).fit()
    _write_record(record_url, setup.storage_options, {
        "run_url": result.run_url,
        "history": result.history,
        "checkpoints": [getattr(c, "url", str(c)) for c in result.checkpoints],
        "config": config,
    })


def _trial_dirname(trial: Any) -> str:
    """Short, stable trial folder names (Tune's default embeds the whole config)."""
    return f"trial_{trial.trial_id}"


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


def _flatten(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _native(value: Any) -> Any:
    """numpy scalars (from Tune's result frames) as Python values."""
    return value.item() if hasattr(value, "item") and getattr(value, "shape", None) == () else value


def _history_of(result: Any) -> List[Dict[str, Any]]:
    """The entries Tune received for one trial (from its result.json), NaN-free."""
    frame = None
    try:
        frame = result.metrics_dataframe
    except Exception:  # no result files (trial never reported)
        frame = None
    if frame is None or len(frame) == 0:
        return [dict(result.metrics)] if result.metrics else []
    entries = []
    for row in frame.to_dict("records"):
        row = {k: _native(v) for k, v in row.items()}
        entries.append({k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})
    return entries


@dataclass
class SweepResult:
    """The outcome of `sweep`: one row per trial, best first, and the best algorithm set.

    ``rows`` are dicts with ``trial_id``, ``algorithms`` (the set's label),
    ``algorithm_specs`` (the set as given), the trial's other ``params`` (flattened, also as
    top-level keys), the metric (its last reported value), ``time/epoch|batch|sample|token`` and
    ``world_size`` of the last result Tune got, ``status`` (``"completed"``: reached
    ``max_duration``; ``"stopped"``: stopped early by the scheduler; ``"error"``), ``error``,
    ``checkpoint`` (the trial's best checkpoint path or None), ``run_url`` (its Train run folder)
    and ``path`` (its Tune trial folder).
    """

    metric: str
    mode: str
    rows: List[Dict[str, Any]]
    path: str
    result_grid: Any = None
    histories: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    time_attr: str = "time/sample"

    @property
    def best(self) -> Optional[Dict[str, Any]]:
        """The best trial's row: the best last value of the metric among trials that did not fail."""
        if not self.rows or self.rows[0].get(self.metric) is None or self.rows[0]["status"] == "error":
            return None
        return self.rows[0]

    @property
    def best_algorithms(self) -> Optional[List[Any]]:
        """The best trial's algorithm set (a list of specs)."""
        return None if self.best is None else self.best["algorithm_specs"]

    @property
    def best_label(self) -> Optional[str]:
        return None if self.best is None else self.best["algorithms"]

    @property
    def best_config(self) -> Optional[Dict[str, Any]]:
        """The best trial's full config (as Tune sampled it)."""
        return None if self.best is None else self.best["config"]

    @property
    def best_checkpoint(self) -> Optional[str]:
        """Path/URL of the best trial's best checkpoint (None if it saved none)."""
        return None if self.best is None else self.best["checkpoint"]

    @property
    def errors(self) -> List[Dict[str, Any]]:
        return [row for row in self.rows if row["status"] == "error"]

    def to_table(self) -> str:
        """A plain-text table of the trials, best first (``*`` marks the best)."""
        params = sorted({k for row in self.rows for k in row["params"]})
        times = [self.time_attr] if self.time_attr in TIME_ATTRS else []
        times += [t for t in ("time/sample",) if t not in times]
        header = ["", "trial", "status", "algorithms", *params, self.metric, *times]
        best = self.best
        lines = []
        for row in self.rows:
            cells = ["*" if best is not None and row is best else "", row["trial_id"], row["status"], row["algorithms"]]
            cells += [_fmt(row["params"].get(p)) for p in params]
            cells += [_fmt(row.get(self.metric))] + [_fmt(row.get(t)) for t in times]
            lines.append(cells)
        widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
        out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_table()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _better(a: float, b: float, mode: str) -> bool:
    return a > b if mode == "max" else a < b


def _best_checkpoint(history: List[Dict[str, Any]], metric: str, mode: str, run_url: str,
                     storage_options: Dict[str, Any]) -> Optional[str]:
    """The reported checkpoint with the best metric (else the newest), or the newest saved one."""
    best: Optional[Tuple[float, str]] = None
    newest: Optional[str] = None
    for entry in history:
        path = entry.get("checkpoint_path")
        if not path:
            continue
        newest = path
        value = entry.get(metric)
        if _finite(value) and (best is None or _better(value, best[0], mode) or value == best[0]):
            best = (value, path)
    if best is not None:
        return best[1]
    if newest is not None:
        return newest
    try:
        from raytrain_events.checkpoint.store import latest_checkpoint
        from raytrain_events.storage.fs import join

        info = latest_checkpoint(join(run_url, "checkpoints"), storage_options=storage_options)
    except Exception:  # no checkpoints, or checkpointing not available
        return None
    return None if info is None else info.url


def _make_result(result_grid: Any, *, metric: str, mode: str, trainer: Mapping[str, Any], experiment_url: str,
                 storage_options: Dict[str, Any], time_attr: str, max_t: Any = None) -> SweepResult:
    from raytrain_events.core.time import TimeUnit, ensure_time
    from raytrain_events.storage.fs import join

    rows: List[Dict[str, Any]] = []
    histories: Dict[str, List[Dict[str, Any]]] = {}
    for result in result_grid:
        config = dict(result.config or {})
        history = _history_of(result)
        last = history[-1] if history else dict(result.metrics or {})
        trial_id = last.get("trial_id") or (result.metrics or {}).get("trial_id") or os.path.basename(result.path)
        histories[trial_id] = history
        values = [e[metric] for e in history if _finite(e.get(metric))]
        specs = _normalize_set(config["algorithms"]) if "algorithms" in config else _normalize_set(trainer.get("algorithms"))
        params = _flatten({k: v for k, v in config.items() if k != "algorithms"})
        overrides = config.get("trainer") or {}
        duration = ensure_time(overrides.get("max_duration", trainer.get("max_duration")), TimeUnit.EPOCH)
        done_key = _UNIT_KEYS.get(duration.unit.value)
        reached = done_key is not None and _finite(last.get(done_key)) and last[done_key] >= duration.value
        # A scheduler stops a trial at its budget (ASHA's max_t with stop_last_trials), maybe one
        # report before the trainer's own end: that trial completed too.
        budget = _finite(max_t) and _finite(last.get(time_attr)) and last[time_attr] >= max_t
        if result.error is not None:
            status = "error"
        elif last.get("final") or reached or budget:
            status = "completed"
        elif history:
            status = "stopped"
        else:
            status = "no results"
        run_url = join(experiment_url, os.path.basename(result.path.rstrip("/")), TRIAL_RUN_NAME)
        row: Dict[str, Any] = {
            "trial_id": trial_id,
            "algorithms": algorithm_set_label(specs),
            "algorithm_specs": specs,
            **params,
            "params": params,
            "config": config,
            metric: values[-1] if values else None,
            **{t: last.get(t) for t in TIME_ATTRS},
            "world_size": last.get("world_size"),
            "status": status,
            "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}",
            "checkpoint": _best_checkpoint(history, metric, mode, run_url, storage_options),
            "run_url": run_url,
            "path": result.path,
        }
        rows.append(row)

    def key(row: Dict[str, Any]):  # best first; trials that failed rank after all that did not
        value = row[metric]
        if value is None:
            return (2, 0.0, row["trial_id"])
        return (1 if row["status"] == "error" else 0, -value if mode == "max" else value, row["trial_id"])

    rows.sort(key=key)
    return SweepResult(metric=metric, mode=mode, rows=rows, path=experiment_url, result_grid=result_grid,
                       histories=histories, time_attr=time_attr)


# ----------------------------------------------------------------------------------------------
# sweep()
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
    trainer: Mapping[str, Any],
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
        trainer: `RayTrainer` keyword arguments shared by all trials (``model``, ``optimizers``,
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
        verbose: Tune's console verbosity (0-3).
    """
    import ray
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    from raytrain_events.ray.cluster import ensure_ray
    from raytrain_events.ray.driver import RayTrainer, _ray_storage, _storage_root
    from raytrain_events.storage.fs import join

    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'.")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r} must be the name of a reported metric, like 'metrics/eval/accuracy'.")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be an integer >= 1.")
    if max_concurrent_trials is not None and (not isinstance(max_concurrent_trials, int) or max_concurrent_trials < 1):
        raise ValueError(f"max_concurrent_trials={max_concurrent_trials!r} must be an integer >= 1 (or None).")
    trainer = dict(trainer)
    _check_trainer_keys(list(trainer), "trainer")
    param_space = dict(param_space or {})
    for key in ("model", "optimizers", "max_duration", "datasets"):
        if key not in trainer:
            raise ValueError(f"trainer has no {key!r}: pass the RayTrainer arguments, e.g. trainer=dict(model=..., "
                             "optimizers=..., datasets={'train': ds}, max_duration='2ep').")
    if "algorithms" in param_space:
        for choice in _algorithm_choices(param_space["algorithms"]):
            _validate_set(choice)
    overrides = param_space.get("trainer")
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise TypeError(f"param_space['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
        _check_trainer_keys(list(overrides), "param_space['trainer']")
    # Build one trainer here (nothing runs) so that bad arguments fail before any trial starts.
    probe_kwargs = dict(trainer)
    if callable(probe_kwargs["datasets"]):
        probe_kwargs["datasets"] = {"train": None}
    probe = RayTrainer(**probe_kwargs)
    time_attr = _scheduler_time_attr(scheduler)
    if time_attr is not None and time_attr.startswith("time/") and time_attr not in TIME_ATTRS:
        raise ValueError(f"scheduler time_attr={time_attr!r} is not reported; use one of {', '.join(TIME_ATTRS)}.")
    if time_attr == "time/token" and trainer.get("get_num_tokens_in_batch") is None:
        raise ValueError("scheduler time_attr='time/token' needs trainer['get_num_tokens_in_batch'] (else tokens stay 0).")

    ensure_ray()
    storage_options = dict(storage_options or {})
    root = _storage_root(storage_path)
    name = name or datetime.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
    experiment_url = join(root, name)
    tune_storage, tune_fs = _ray_storage(root, storage_options)
    experiment_path = tune_storage.rstrip("/") + "/" + name

    if max_concurrent_trials is None:
        max_concurrent_trials = _default_concurrency(probe.scaling_config)
    restoring = resume and tune.Tuner.can_restore(experiment_path, storage_filesystem=tune_fs)
    if not restoring and _experiment_exists(experiment_url, storage_options):
        if not resume:
            raise FileExistsError(f"{experiment_url} already exists: pass resume=True to continue that sweep, "
                                  "or choose another name (or storage_path).")
        raise FileExistsError(f"{experiment_url} holds files but no sweep Tune can resume (no tuner.pkl/experiment "
                              "state): choose another name (or storage_path), or remove that folder.")

    registry = _start_registry(experiment_url)
    try:
        setup = _TrialSetup(trainer=trainer, experiment_url=experiment_url, storage_options=storage_options,
                            registry=registry)
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
                    callbacks=[JsonLoggerCallback(), _ReleaseTrainWorkers(experiment_url), *callbacks],
                    failure_config=tune.FailureConfig(max_failures=trial_max_failures),
                    verbose=verbose,
                ),
            )
        # Entries between evaluations lack eval metrics: they must still reach the scheduler and the
        # history (schedulers skip results without the metric), so Tune must not reject them.
        previous = os.environ.get("TUNE_DISABLE_STRICT_METRIC_CHECKING")
        os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
        try:
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
        result_grid, metric=metric, mode=mode, trainer=trainer, experiment_url=experiment_url,
        storage_options=storage_options, time_attr=time_attr or "time/sample",
        max_t=getattr(scheduler, "_max_t", None) if time_attr else None,
    )
    if result.best is None and result.rows and not result.errors:
        seen = sorted({k for h in result.histories.values() for e in h for k in e if _finite(e.get(k))})
        raise ValueError(
            f"No trial reported metric {metric!r}; reported metrics: {', '.join(k for k in seen if '/' in k) or 'none'}. "
            f"The trials' results are kept in {experiment_url}."
        )
    return result
