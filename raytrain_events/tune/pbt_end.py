"""PBT that knows a trial's final report and the sweep's room: no copy at a final report, no needless pauses.

Tune's `PopulationBasedTraining` ranks every trial that has reported and is not finished, and Tune
marks a trial finished only when its function returns, after its last result. So at a trial's
final report (``final``: the run reached its duration or stopped) plain PBT can still act twice on
a run that will train nothing more:

* the finishing trial, ranked in the bottom quantile, *exploits*: it restarts from a donor's
  checkpoint to train the batches left, none (a whole worker group started, on a cluster GPUs
  reserved and a checkpoint loaded, for no step);
* a trial in the bottom quantile copies a donor whose last result was its final one: it jumps to
  the donor's end and trains nothing either, a copy of a finished run with no exploration in it.

`EndAwarePBT` takes a trial out of the ranking at its final report (as Tune does when its function
returns, a few seconds earlier) and lets that result pass without a perturbation.

Asynchronous PBT also *pauses* a trial at its perturbation point whenever another trial is pending or
paused: Tune's time-multiplexing, for a population larger than the cluster holds, so that waiting
trials get the resources. A trial that has just copied a donor is paused (and restarts on the copy)
at every such point, so every trial reaching a point meanwhile was paused too: its Ray Train run
ended and restarted from its own checkpoint, a worker-group start-up that trained nothing new (seen
in ``examples/tune_pbt.py``: 2 of 6 runs). When the sweep runs every live trial at once
(``trials_at_once``, which `sweep` sets: ``max_concurrent_trials`` and what the cluster holds),
nothing waits for resources, and such a trial goes on instead. Mid-run copies are unchanged.
Asynchronous PBT only: `pbt_scheduler(synch=True)` keeps Tune's own class, which waits for every
trial to reach each perturbation point, final reports included.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

from raytrain_events.ray import _compat

__all__ = ["EndAwarePBT"]


class EndAwarePBT(PopulationBasedTraining):
    """`PopulationBasedTraining` that neither copies into nor out of a trial at or after its final report,
    and pauses no trial for time-multiplexing while every live trial can run at once."""

    #: How many trials the sweep runs at once (set by `sweep`); None: Tune's pausing, whatever the room.
    trials_at_once: Optional[int] = None

    def on_trial_result(self, tune_controller: Any, trial: Any, result: Dict[str, Any]) -> str:
        if result.get("final"):
            _compat.pbt_retire_trial(self, trial)
            return TrialScheduler.CONTINUE
        decision = super().on_trial_result(tune_controller, trial, result)
        # Asynchronous PBT answers PAUSE only to make room for pending or paused trials (a copied trial
        # answers NOOP: it is paused already, to restart on its copy).
        if decision == TrialScheduler.PAUSE and self._all_run_at_once(tune_controller):
            return TrialScheduler.CONTINUE
        return decision

    def _all_run_at_once(self, tune_controller: Any) -> bool:
        if self.trials_at_once is None:
            return False
        live = [t for t in tune_controller.get_trials() if not t.is_finished()]
        return len(live) <= self.trials_at_once
