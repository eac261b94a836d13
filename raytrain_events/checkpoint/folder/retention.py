"""Checkpoint retention and placement, decided once: what each process deletes and where it saves.

Before, ``keep``/``keep_best`` were interpreted in five modules (the local `Checkpointer`, the
Ray worker, the driver, `RunSpec` and Tune's trial setup) with the ``keep_best`` metric check
written twice. Now:

* ``local_keep(config)``: a plain `Trainer` prunes to the newest ``keep`` itself (its
  `CheckpointIndex`, no listing per commit); ``keep_best`` needs Ray Train's manager: refused.
* ``ray_plan(config, run_url, storage_options)``: ONE mapping of a `CheckpointConfig` to
  (a) the workers' `CheckpointConfig`: save under ``<run>/checkpoints``, never prune (Ray does,
  see ``ray/checkpointing/checkpointing.py`` for why), resume from the newest committed checkpoint; and
  (b) the values for Ray's ``CheckpointConfig`` (``num_to_keep``, score attribute and order);
  plus whether the driver cleans unlisted directories after the fit (``prunes``).
* ``check_ray_ranking(config)``: on Ray, ``keep_best`` ranks by an eval metric reported as
  ``metrics/<set>/<name>`` (the same on every rank); checked where the option enters (`RunSpec`).
* ``for_trial(config, ...)``: a Tune trial's retention (keep the best by the sweep's metric).

No Ray import here: ``ray/checkpointing/checkpointing.py`` turns a plan into Ray's own object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.storage.run_dir import checkpoints_url

__all__ = ["CheckpointPlan", "check_ray_ranking", "for_trial", "local_keep", "ray_plan"]


@dataclass(frozen=True)
class CheckpointPlan:
    """A `CheckpointConfig` mapped onto a Ray run: the workers' config and Ray's retention."""

    worker: CheckpointConfig
    num_to_keep: Optional[int]
    score_attribute: Optional[str]
    score_order: str
    prunes: bool  # something is deleted (the driver removes what Ray's final snapshot dropped)


def check_ray_ranking(config: CheckpointConfig) -> None:
    """On Ray, ``keep_best`` ranks by a metric of rank 0's report that every rank agrees on."""
    if config.keep_best is not None and not str(config.metric).startswith("metrics/"):
        raise ValueError(
            f"CheckpointConfig(keep_best={config.keep_best}, metric={config.metric!r}): on Ray, checkpoints are "
            "ranked by an eval metric ('metrics/<eval set>/<name>', the same on every rank), like "
            "'metrics/eval/accuracy'."
        )


def local_keep(config: CheckpointConfig) -> Optional[int]:
    """How many checkpoints a plain (non-Ray) `Trainer` keeps; None keeps all."""
    if config.keep_best is not None:
        raise ValueError(
            f"CheckpointConfig(keep_best={config.keep_best}) is applied by Ray Train's checkpoint manager: "
            "use it with RayTrainer, or pass keep=N to keep the newest N checkpoints."
        )
    return config.keep


def ray_plan(config: CheckpointConfig, *, run_url: str, storage_options: Dict[str, Any]) -> CheckpointPlan:
    """The one mapping of a run's `CheckpointConfig` onto its workers and Ray Train."""
    check_ray_ranking(config)
    options = dict(storage_options)
    options.update(config.storage_options)
    worker = dataclasses.replace(
        config,
        save_folder=checkpoints_url(run_url),
        storage_options=options,
        keep=None,  # Ray's num_to_keep prunes (ray/checkpointing/checkpointing.py)
        keep_best=None,
        only_save_most_recent=False,
        # A restart, an elastic resize or a run continued by name resumes from the newest committed
        # checkpoint of the run dir; load_from (and its weights-only/ignore options) only when there is none.
        autoresume=True,
    )
    if config.keep_best is None:
        return CheckpointPlan(worker, config.keep, None, "max", prunes=config.keep is not None)
    return CheckpointPlan(worker, config.keep_best, "metrics/" + str(config.metric), config.mode, prunes=True)


def for_trial(
    config: CheckpointConfig, *, metric: Optional[str], mode: str, keep_every: bool
) -> Optional[CheckpointConfig]:
    """A Tune trial's `CheckpointConfig`, or None when the run's own applies unchanged.

    ``keep_every`` (a PBT donor): never prune, a trial it reported to may still be loading one.
    Otherwise ``keep=N`` becomes the N best by the sweep's metric (pruning by age could delete
    the sweep's best checkpoint); Ray Train's manager also keeps the newest, for resuming.
    """
    if keep_every:
        return dataclasses.replace(config, keep=None, keep_best=None, only_save_most_recent=False)
    if config.keep is not None and (metric or "").startswith("metrics/"):
        return dataclasses.replace(
            config, keep=None, only_save_most_recent=False, keep_best=config.keep, metric=metric, mode=mode
        )
    return None
