"""What one Tune trial runs: the sweep's base `RunSpec` with the trial's overrides, as a `RayTrainer` run.

A finished trial writes ``raytrain_trial.json`` (its history, checkpoints and run URL) into its
Tune trial folder; a trial restarted by a resumed sweep that finds that record replays it to
Tune instead of training again (Tune may not have saved that the trial finished).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from raytrain_events.ray.spec import RunSpec, check_option_names
from raytrain_events.tune.placement import _trial_callbacks
from raytrain_events.tune.pointer import pointer_from_entry, write_pointer
from raytrain_events.tune.results import TRIAL_RECORD, TRIAL_RUN_NAME
from raytrain_events.tune.sets import _normalize_set

logger = logging.getLogger(__name__)

#: RayTrainer arguments the sweep sets itself, and what to do instead.
SWEEP_OWNED = {
    "storage_path": "pass sweep(storage_path=...): each trial's run goes into its own folder under the sweep",
    "storage_options": "pass sweep(storage_options=...)",
    "run_name": "each trial's run is named by the sweep",
}


@dataclass
class TrialSetup:
    """What every trial needs from the sweep (shipped once through the object store)."""

    spec: RunSpec  # the base spec every trial starts from
    experiment_url: str
    storage_options: Dict[str, Any]
    registry: Any = None  # the sweep's placement-group registry actor
    metric: Optional[str] = None  # the sweep's metric and mode: a trial keeps its best checkpoints by them
    mode: str = "max"


def check_trainer_keys(keys: Sequence[str], where: str) -> None:
    """Refuse options the sweep owns, and names that are not `RunSpec` options."""
    for key in keys:
        if key in SWEEP_OWNED:
            raise ValueError(f"{where}[{key!r}] is set by the sweep: {SWEEP_OWNED[key]}.")
    check_option_names(keys, where)


def base_spec(trainer: Any) -> RunSpec:
    """The `RunSpec` every trial starts from (validated now, so bad options fail before any trial)."""
    if isinstance(trainer, RunSpec):
        return trainer
    if not isinstance(trainer, Mapping):
        raise TypeError(f"trainer must be a RunSpec or a dict of RayTrainer arguments, got {trainer!r}.")
    check_trainer_keys(list(trainer), "trainer")
    return RunSpec.from_options(trainer, "sweep(trainer=...)")


def trial_spec(base: RunSpec, config: Mapping[str, Any]) -> RunSpec:
    """One trial's `RunSpec`: ``base`` with the trial's overrides, algorithm set and config merged in.

    ``config["trainer"]`` holds `RayTrainer` overrides; ``config["algorithms"]`` replaces the
    base's algorithm set; the whole trial config is merged over ``base.config``. The result is a
    ``dataclasses.replace`` of ``base``, validated like a new spec.
    """
    config = dict(config)
    overrides = config.get("trainer") or {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"config['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
    check_trainer_keys(list(overrides), "param_space['trainer']")
    changes = dict(overrides)
    if "algorithms" in config:
        changes["algorithms"] = _normalize_set(config["algorithms"])
    changes["config"] = {**base.config, **config}
    changes["progress_bar"] = False
    return base.replace(**changes)


def raytrain_trial(config: Dict[str, Any], sweep_setup: Optional[TrialSetup] = None) -> None:
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
        logger.warning(
            "%s already finished (%s): replaying its %d results instead of training again.",
            trial_folder,
            record_url,
            len(record["history"]),
        )
        for entry in record["history"]:
            tune.report(dict(entry))
        return
    spec = trial_retention_and_loggers(trial_spec(setup.spec, config), config, trial_folder, setup)
    algorithms = list(spec.algorithms) if isinstance(spec.algorithms, (list, tuple)) else []  # not a factory
    callbacks = functools.partial(_trial_callbacks, spec.callbacks, setup.registry, tune.get_context().get_trial_id())
    trainer = RayTrainer(
        spec,
        callbacks=callbacks,
        storage_path=trial_url,
        storage_options=setup.storage_options,
        run_name=TRIAL_RUN_NAME,
    )
    result = fit_reporting_to_tune(trainer, trial_folder, algorithms)
    write_record(
        record_url,
        setup.storage_options,
        {
            "run_url": result.run_url,
            "history": result.history,
            "checkpoints": [getattr(c, "url", str(c)) for c in result.checkpoints],
            "config": config,
        },
    )


def fit_reporting_to_tune(trainer: Any, trial_folder: str, algorithms: List[Any]) -> Any:
    """``trainer.fit()`` in a background thread while this (the trial's) thread reports to Tune.

    The driver's controller callback puts every aggregated history entry (global counts, not
    rank 0's) on a ``ray.util.queue.Queue``; this thread takes them in order and calls
    ``ray.tune.report``. An entry naming a newly committed checkpoint is reported with a
    `CheckpointPointer` checkpoint (a tiny directory: Tune copies the pointer, never the model
    bytes), so schedulers that restore trials from checkpoints (PBT) can. The queue holds one
    entry, so the run waits for Tune to take each result (as Ray's own Tune integration does).
    ``fit``'s exception is raised here, after the results before it were reported.
    """
    from ray import tune
    from ray.util.queue import Queue

    queue = Queue(maxsize=1, actor_options={"num_cpus": 0})
    outcome: Dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = trainer.fit(report_queue=queue)
        except BaseException as exc:  # raised again in the trial's thread
            outcome["error"] = exc
        finally:
            queue.put(_FIT_DONE)

    thread = threading.Thread(target=run, name=f"raytrain-fit-{trial_folder}", daemon=True)
    thread.start()
    while True:
        entry = queue.get()
        if entry == _FIT_DONE:
            break
        pointer = pointer_from_entry(entry, trainer.run_url, trial_folder, trainer.run_name, algorithms)
        if pointer is None:
            tune.report(dict(entry))
            continue
        with tempfile.TemporaryDirectory(prefix="raytrain-pointer-") as folder:
            write_pointer(folder, pointer)
            tune.report(dict(entry), checkpoint=tune.Checkpoint.from_directory(folder))
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


#: What the fit thread puts on the report queue when ``fit`` returned or raised.
_FIT_DONE = {"__raytrain_fit_done__": True}


def trial_retention_and_loggers(
    spec: RunSpec, config: Mapping[str, Any], trial_folder: str, setup: TrialSetup
) -> RunSpec:
    """A trial's spec whose checkpoints keep its best by the sweep's metric (never pruned) and whose
    loggers' runs are named after the trial and its algorithm set."""
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
        from raytrain_events.tune.console import trial_label

        name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"{trial_folder}-{trial_label(dict(config))}").strip("_")
        changes["loggers"] = [name_destination(d, name) for d in spec.loggers]
    return spec.replace(**changes) if changes else spec


def trial_dirname(trial: Any) -> str:
    """Short, stable trial folder names (Tune's default embeds the whole config)."""
    return f"trial_{trial.trial_id}"


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


def write_record(url: str, storage_options: Dict[str, Any], record: Any) -> None:
    from raytrain_events.core.plain import to_plain
    from raytrain_events.storage.fs import resolve, write_bytes_atomic

    fs, path = resolve(url, storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_bytes_atomic(fs, path, json.dumps(to_plain(record, fallback=repr), indent=1).encode())
