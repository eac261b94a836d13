"""What `sweep()` checks before Ray starts and before any trial trains, beyond each argument's own value.

The trials' base `RunSpec` through the same driver checks as a `RayTrainer` (`check_on_driver`, without
calling the factories, which read each trial's config: each trial's `RayTrainer.fit` builds them);
every value ``param_space["trainer"]`` lists (a grid's values, a categorical's categories, and
their combinations) applied to it with `RunSpec.replace`, so a batch size of 0 or ``"1.5ep"``
fails now and not in its trial; the ``metric`` against the run's eval sets (a metric of an eval
set the run lacks would be found only after every trial trained); the storage path; PBT without
checkpoints, and PBT scoring trials by a metric `AsyncValidation` computes (its results come after their
checkpoint's, with none of their own: PBT could never exploit either; Tune only logs "Skip exploit"). Cost: one `RunSpec` per listed
value (up to `MAX_COMBINATIONS` combinations), no Ray.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Mapping, Optional

from raytrain_events.ray.async_validation import async_eval_names
from raytrain_events.ray.driver_checks import check_on_driver
from raytrain_events.ray.spec import RunSpec
from raytrain_events.ray.spec_checks import check_ray_storage
from raytrain_events.storage.fs import check_storage_url
from raytrain_events.tune.sets import space_choices

__all__ = ["check_sweep", "MAX_COMBINATIONS"]

MAX_COMBINATIONS = 256  # grid combinations checked together (beyond: each value alone)


def check_sweep(
    base: RunSpec, param_space: Mapping[str, Any], metric: str, storage_path: Optional[str], pbt: bool
) -> None:
    """Refuse a sweep whose trials would fail or search nothing; see the module doc."""
    if storage_path is not None:
        check_storage_url(storage_path)
    check_ray_storage(storage_path, "storage_path")
    check_on_driver(base, build=False)  # the factories read each trial's config: its own fit builds them
    _check_trainer_grid(base, param_space.get("trainer"))
    _check_metric(base, param_space.get("trainer"), metric)
    if pbt and base.checkpoints.checkpoint is None:
        raise ValueError(
            "A PBT sweep copies the best trials' checkpoints into the worst, and trainer= saves none: it would never "
            "exploit (Tune only logs 'Skip exploit'). Fix: trainer['checkpoint'] = CheckpointConfig(save_interval=...) "
            "at the scheduler's interval or finer (e.g. save_interval='512sp')."
        )
    if pbt:
        _check_pbt_metric(base, metric)


def _check_pbt_metric(base: RunSpec, metric: str) -> None:
    """PBT copies the checkpoint reported with the result it acts on; an asynchronously validated metric's
    result comes after its checkpoint's, with none of its own."""
    parts = metric.split("/")
    validated = async_eval_names(base.checkpoints.validation, base.data.eval_names)
    if parts[0] == "metrics" and len(parts) >= 3 and parts[1] in validated:
        raise ValueError(
            f"A PBT sweep scores trials by metric={metric!r}, and validation=AsyncValidation(...) computes it as a "
            "Ray task after its checkpoint was reported: PBT would act on that result, which carries no checkpoint, "
            f"and never exploit (Tune only logs 'Skip exploit'). Fix: evaluate {parts[1]!r} in the loop (leave it out "
            "of AsyncValidation(datasets=...)), or use another scheduler (ASHA stops trials without copying them)."
        )


def _check_trainer_grid(base: RunSpec, overrides: Any) -> None:
    if not isinstance(overrides, Mapping) or not overrides:
        return
    choices: Dict[str, List[Any]] = {key: space_choices(value) for key, value in overrides.items()}
    choices = {key: values for key, values in choices.items() if values}
    for key, values in choices.items():
        for value in values:
            _try(base, {key: value})
    sizes = 1
    for values in choices.values():
        sizes *= len(values)
    if 1 < len(choices) and sizes <= MAX_COMBINATIONS:
        for combination in itertools.product(*choices.values()):
            _try(base, dict(zip(choices, combination)))


def _try(base: RunSpec, changes: Dict[str, Any]) -> None:
    try:
        base.replace(**changes)
    except (TypeError, ValueError, OSError) as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        raise type(exc)(f"param_space['trainer'] lists {given}, which no trial could run: {exc}") from exc


def _check_metric(base: RunSpec, overrides: Any, metric: str) -> None:
    """``metrics/<eval set>/<name>`` must name one of the run's eval sets (when the datasets are a dict)."""
    parts = metric.split("/")
    if parts[0] != "metrics" or len(parts) < 3 or not isinstance(base.data.datasets, Mapping):
        return
    if isinstance(overrides, Mapping) and "datasets" in overrides:
        return  # the trials' own datasets: checked in each trial
    names = base.data.eval_names
    if parts[1] not in names:
        examples = [f"metrics/{name}/{'/'.join(parts[2:])}" for name in names] or ["train/loss"]
        raise ValueError(
            f"metric={metric!r} names eval set {parts[1]!r}, which this run does not have (its eval sets: {names}): "
            f"no trial would report it. Fix: metric={examples[0]!r}, or add {parts[1]!r} to trainer['datasets']."
        )
