"""What one Tune trial runs: the sweep's base `RunSpec` with the trial's overrides, as a `RayTrainer` run.

A finished trial writes ``raytrain_trial.json`` (its history, checkpoints and run URL) into its
Tune trial folder; a trial restarted by a resumed sweep that finds that record replays it to
Tune instead of training again (Tune may not have saved that the trial finished), unless Tune
restores it from a checkpoint of another run (a PBT copy, `run_to_continue`).
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
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.checkpoint.folder.retention import for_trial
from raytrain_events.core.mixture import Mixture
from raytrain_events.core.plain import to_plain
from raytrain_events.ray.reports.run_loggers import name_destination
from raytrain_events.ray.spec import RunSpec, check_option_names
from raytrain_events.storage.fs import join, read_bytes, resolve, write_bytes_atomic
from raytrain_events.storage.fs import join as join_url
from raytrain_events.tune.console import trial_label
from raytrain_events.tune.mixture_pbt import copy_mixture
from raytrain_events.tune.placement import trial_callbacks
from raytrain_events.tune.pointer import CheckpointPointer, pointer_from_entry, read_pointer, write_pointer
from raytrain_events.tune.results import LINEAGE_FILE, TRIAL_RECORD, TRIAL_RUN_NAME, read_lineage
from raytrain_events.tune.sets import normalize_set
from raytrain_events.tune.simplex import base_mixture, check_mixture_choice, trial_mixture

logger = logging.getLogger(__name__)

#: The name of a run that copied another trial starts with this (``from-<trial>-<checkpoint>``).
COPIED_RUN_PREFIX = "from-"

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
    keep_every_checkpoint: bool = False  # PBT: another trial may load any reported checkpoint later


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
    base's algorithm set; ``config["mixture"]`` (weights) replaces the first stage of the base's
    mixture (`raytrain_events.tune.simplex.trial_mixture`); the whole trial config is merged over
    ``base.config``. The result is a ``dataclasses.replace`` of ``base``, validated like a new spec.
    """
    config = dict(config)
    overrides = config.get("trainer") or {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"config['trainer'] must be a dict of RayTrainer overrides, got {overrides!r}.")
    check_trainer_keys(list(overrides), "param_space['trainer']")
    changes = dict(overrides)
    if "algorithms" in config:
        changes["algorithms"] = normalize_set(config["algorithms"])
    if "mixture" in config:  # the searched weights (mixture_space): the base mixture with them as its first stage
        mixture = base_mixture(base)
        check_mixture_choice(mixture, config["mixture"])
        assert mixture is not None
        changes["mixture"] = trial_mixture(mixture, config["mixture"])
    changes["config"] = {**base.config, **config}
    changes["progress_bar"] = False
    return base.replace(**changes)


def raytrain_trial(config: Dict[str, Any], sweep_setup: Optional[TrialSetup] = None) -> None:
    """The Tune function trainable: one `RayTrainer` run (or a replay of a finished one)."""
    from ray import tune

    # why here: defers torch.distributed.tensor (the Ray driver, algorithms load it) until a sweep needs it
    from raytrain_events.ray.driver import RayTrainer

    setup = sweep_setup
    if setup is None:
        raise RuntimeError("raytrain_trial runs inside raytrain_events.tune.sweep(); call sweep() instead.")
    trial_folder = os.path.basename(tune.get_context().get_trial_dir().rstrip("/"))
    trial_url = join(setup.experiment_url, trial_folder)
    record_url = join(trial_url, TRIAL_RECORD)
    pointer = _restored_pointer()
    replay = results_to_replay(_read_record(record_url, setup.storage_options), pointer)
    if replay is not None:
        # Finished before the sweep was interrupted, but Tune's saved state did not know yet.
        logger.warning(
            "%s already finished (%s): replaying %d results instead of training again.",
            trial_folder,
            record_url,
            len(replay),
        )
        for entry in replay:
            tune.report(dict(entry))
        return
    spec = trial_retention_and_loggers(trial_spec(setup.spec, config), config, trial_folder, setup)
    algorithms = list(spec.algorithms) if isinstance(spec.algorithms, (list, tuple)) else []  # not a factory
    run_name, spec = run_to_continue(spec, pointer, trial_folder, algorithms, trial_url, setup)
    callbacks = functools.partial(
        trial_callbacks,
        spec.callbacks,
        setup.registry,
        tune.get_context().get_trial_id(),
        copied=run_name.startswith(COPIED_RUN_PREFIX),
    )
    trainer = RayTrainer(
        spec,
        callbacks=callbacks,
        storage_path=trial_url,
        storage_options=setup.storage_options,
        run_name=run_name,
    )
    result = fit_reporting_to_tune(
        trainer, trial_folder, algorithms, mixture=config.get("mixture"), run_mixture=spec.data.mixture
    )
    write_record(
        record_url,
        setup.storage_options,
        {
            "run_url": result.run_url,
            "history": result.history,
            "checkpoints": [getattr(c, "url", str(c)) for c in result.checkpoints],
            "config": config,
            "lineage": read_lineage(trial_url, setup.storage_options),
        },
    )


def results_to_replay(
    record: Optional[Mapping[str, Any]], pointer: Optional[CheckpointPointer]
) -> Optional[List[Dict[str, Any]]]:
    """The finished run's results to report to Tune again, or None to train.

    None without a record, and when the record is of another run than the one Tune restores
    (PBT copied another trial into this one, even at its last report, or restarts such a copy's
    run). Restored from the recorded run's own checkpoint, Tune has its results up to that
    checkpoint: only the later ones (and the final one) are replayed.
    """
    if record is None:
        return None
    if pointer is None:
        return list(record["history"])
    if _run_of(record) != (pointer.trial_folder, pointer.run_name):
        return None
    after = pointer.counters.get("batch", 0)
    return [e for e in record["history"] if e.get("time/batch", 0) > after or e.get("final")]


def _run_of(record: Mapping[str, Any]) -> Tuple[str, str]:
    """(trial folder, run name) of a trial record's run (from its ``run_url``)."""
    parts = str(record.get("run_url", "")).rstrip("/").rsplit("/", 2)
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")


def _restored_pointer() -> Optional[CheckpointPointer]:
    """The pointer Tune restores this trial from (PBT's exploit, a resumed sweep), or None."""
    from ray import tune

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        return read_pointer(folder)


def run_to_continue(
    spec: RunSpec,
    pointer: Optional[CheckpointPointer],
    trial_folder: str,
    algorithms: List[Any],
    trial_url: str,
    setup: TrialSetup,
) -> Tuple[str, RunSpec]:
    """The run (inside the trial folder) this attempt trains, and its spec.

    No pointer: the trial's first run, ``train``. Its own pointer (a restart): the run that
    reported it, which resumes from its newest committed checkpoint. Another trial's pointer
    (PBT copied that trial): a new run named after the donor's checkpoint that fully loads it
    (weights, optimizer state, global Timestamp, data position) with this trial's config,
    optimizer settings (`KeepExploredOptimizerSettings`) and algorithm set, recorded in the
    trial's lineage. The name is deterministic, so a restart
    before this run reported resumes it instead of loading the donor again. Under a mixture, the
    copy's mixture is the donor run's switched at the checkpoint's sample to the trial's weights
    (`copy_mixture`), and a restart resumes on the mixture its run saved (the pointer's).
    """
    if pointer is None:
        return TRIAL_RUN_NAME, spec
    if pointer.trial_folder == trial_folder:
        if spec.data.mixture is not None and pointer.run_mixture is not None:
            spec = spec.replace(mixture=pointer.run_mixture)
        return pointer.run_name, spec
    if spec.checkpoints.checkpoint is None:
        raise ValueError(
            "Tune restores this trial from another trial's checkpoint, but the trial saves none: "
            "pass trainer={'checkpoint': CheckpointConfig(save_interval=...)} to sweep()."
        )
    run_name = f"{COPIED_RUN_PREFIX}{pointer.trial_folder}-{pointer.name}"
    checkpoint = dataclasses.replace(
        spec.checkpoints.checkpoint, load_from=pointer.url, load_weights_only=False, load_ignore_keys=[]
    )
    step = {
        "run_name": run_name,
        "copied_trial": pointer.trial_folder,
        "checkpoint": pointer.url,
        "counters": dict(pointer.counters),
        "from_algorithms": pointer.algorithms,
        "algorithms": algorithms,
    }
    changes: Dict[str, Any] = {"checkpoint": checkpoint}
    if pointer.mixture is not None or spec.config.get("mixture") is not None:  # a mixture search's weights
        step.update(from_mixture=pointer.mixture, mixture=spec.config.get("mixture"))
    mixture = copied_mixture(spec, pointer)
    if mixture is not None:
        changes["mixture"] = mixture
        if mixture.switches and f"{pointer.counters.get('sample', 0)}sp" == mixture.switches[-1]:
            step["switched_at_sample"] = pointer.counters.get("sample", 0)
    add_lineage(trial_url, setup.storage_options, step)
    return run_name, spec.replace(**changes)


def copied_mixture(spec: RunSpec, pointer: CheckpointPointer) -> Any:
    """The `Mixture` a copy of ``pointer``'s trial trains on (`copy_mixture`), or None without a mixture.

    The donor's mixture is the pointer's ``run_mixture``; a pointer without it (written before it
    was recorded) has the donor's searched weights as the first stage of this trial's mixture.
    """
    if spec.data.mixture is None:
        return None
    mine = Mixture.from_dict(spec.data.mixture)
    if pointer.run_mixture is not None:
        donor = Mixture.from_dict(pointer.run_mixture)
    elif pointer.mixture is not None:
        donor = trial_mixture(mine, pointer.mixture)
    else:
        return None
    return copy_mixture(donor, pointer.counters.get("sample", 0), spec.config.get("mixture"), pointer.mixture)


def add_lineage(trial_url: str, storage_options: Dict[str, Any], step: Dict[str, Any]) -> None:
    """Append one exploit to the trial's lineage file (once per run: a restart does not repeat it)."""
    lineage = read_lineage(trial_url, storage_options)
    if any(s.get("run_name") == step["run_name"] for s in lineage):
        return
    logger.info("%s copies %s (%s) at %s.", trial_url, step["copied_trial"], step["checkpoint"], step["counters"])
    write_record(join_url(trial_url, LINEAGE_FILE), storage_options, [*lineage, step])


def fit_reporting_to_tune(
    trainer: Any,
    trial_folder: str,
    algorithms: List[Any],
    mixture: Optional[Mapping[str, float]] = None,
    run_mixture: Optional[Mapping[str, Any]] = None,
) -> Any:
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
        pointer = pointer_from_entry(
            entry, trainer.run_url, trial_folder, trainer.run_name, algorithms, mixture, run_mixture
        )
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
    if spec.checkpoints.checkpoint is not None:
        retention = for_trial(
            spec.checkpoints.checkpoint, metric=setup.metric, mode=setup.mode, keep_every=setup.keep_every_checkpoint
        )
        if retention is not None:
            changes["checkpoint"] = retention
    if spec.reports.driver_loggers:
        name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"{trial_folder}-{trial_label(dict(config))}").strip("_")
        changes["driver_loggers"] = [name_destination(d, name) for d in spec.reports.driver_loggers]
    return spec.replace(**changes) if changes else spec


def trial_dirname(trial: Any) -> str:
    """Short, stable trial folder names (Tune's default embeds the whole config)."""
    return f"trial_{trial.trial_id}"


def _read_record(url: str, storage_options: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    fs, path = resolve(url, storage_options)
    try:
        return json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        return None
    except ValueError:  # a torn or foreign file: train again rather than trust it
        logger.warning("Ignoring unreadable trial record %s; the trial trains again.", url)
        return None


def write_record(url: str, storage_options: Dict[str, Any], record: Any) -> None:
    fs, path = resolve(url, storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_bytes_atomic(fs, path, json.dumps(to_plain(record, fallback=repr), indent=1).encode())
