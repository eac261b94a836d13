"""Release the placement groups of trials Tune stopped.

Tune stops a trial (a scheduler's STOP, a stopper, a time budget) by terminating the trial's
actor. Its Train controller, an actor the trial owns, dies with it, and Train's placement group
for the workers -- scoped to the job, not to the controller -- stays reserved. Ray Train's own
PlacementGroupCleaner releases it through the state API, which needs the dashboard and fails when
several Ray instances run on one machine; then every stopped trial leaks its workers' CPUs/GPUs
and later trials wait forever for resources. So rank 0 of every worker group registers its
placement group with the sweep (`trial_callbacks`), and a Tune callback (`ReleaseTrainWorkers`)
removes a trial's groups shortly after Tune stopped its actor (removing a group Train already
removed is a no-op): when the trial completed, failed or is retried, when a scheduler paused it
(PBT pauses the trials it copies others into; Tune has no pause callback, so each step looks for
newly paused trials), and when a new attempt of the trial starts (the old attempt's groups).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Dict, List, Sequence, Set, Tuple

from ray.tune import Callback

from raytrain_events.ray.spec import call_factory
from raytrain_events.tune.explore import KeepExploredOptimizerSettings

logger = logging.getLogger(__name__)


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
    return "raytrain_events.tune.placement_groups." + hashlib.sha1(experiment_url.encode()).hexdigest()[:16]


def start_registry(experiment_url: str) -> Any:
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


def trial_callbacks(
    user_callbacks: Any, registry: Any, trial_id: str, config: Dict[str, Any], copied: bool = False
) -> List[Any]:
    """The trainer's callbacks factory in a sweep: the user's callbacks, after registering the group.

    ``copied``: the run loads another trial's checkpoint (PBT), so its optimizers get this trial's
    explored settings back after the load (`KeepExploredOptimizerSettings`).
    """
    _register_placement_group(registry, trial_id)
    callbacks = list(call_factory(user_callbacks, config) if callable(user_callbacks) else (user_callbacks or ()))
    return [*callbacks, KeepExploredOptimizerSettings()] if copied else callbacks


def release_placement_groups(groups: Sequence[Any]) -> None:
    from ray.util import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # already removed, or the cluster is going away
            logger.debug("Could not remove placement group %s", getattr(group, "id", group), exc_info=True)


class ReleaseTrainWorkers(Callback):
    """Tune callback: remove a finished trial's Train placement groups ``grace_s`` after it ended.

    The grace lets Tune terminate the trial actor first, so its Train run is not torn down under it.
    """

    def __init__(self, experiment_url: str, grace_s: float = 3.0) -> None:
        self.experiment_url = experiment_url
        self.grace_s = grace_s
        self.pending: List[Tuple[float, List[Any]]] = []
        self.paused: Set[str] = set()  # trials whose pause was handled (until they start again)

    def __getstate__(self) -> Dict[str, Any]:  # pickled into the sweep's tuner.pkl: nothing pending
        return {"experiment_url": self.experiment_url, "grace_s": self.grace_s, "pending": [], "paused": set()}

    def _registry(self) -> Any:
        import ray

        try:
            return ray.get_actor(_registry_name(self.experiment_url))
        except ValueError:
            return None

    def _trial_ended(self, trial: Any) -> None:
        import ray

        registry = self._registry()
        if registry is not None:  # take the groups now: a retried trial registers new ones
            groups = ray.get(registry.pop.remote(trial.trial_id))
            if groups:
                self.pending.append((time.monotonic(), groups))

    def on_trial_start(self, iteration, trials, trial, **info):
        # Any groups still registered belong to an earlier attempt whose actor Tune stopped (a
        # pause); this attempt registers its own only once its Train workers run.
        self.paused.discard(trial.trial_id)
        self._trial_ended(trial)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._trial_ended(trial)

    def on_step_begin(self, iteration, trials, **info):
        for trial in trials:  # Tune stops a paused trial's actor and has no callback for it
            if trial.status == "PAUSED" and trial.trial_id not in self.paused:
                self.paused.add(trial.trial_id)
                self._trial_ended(trial)
        if not self.pending:
            return
        now = time.monotonic()
        due = [groups for ended, groups in self.pending if now - ended >= self.grace_s]
        self.pending = [(ended, groups) for ended, groups in self.pending if now - ended < self.grace_s]
        for groups in due:
            release_placement_groups(groups)

    def on_experiment_end(self, trials, **info):
        for _, groups in self.pending:
            release_placement_groups(groups)
        self.pending = []
