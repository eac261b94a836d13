"""PBT that knows a trial's final report: no copy into or out of a trial that has finished training.

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
returns, a few seconds earlier) and lets that result pass without a perturbation. Mid-run copies
are unchanged. Asynchronous PBT only: `pbt_scheduler(synch=True)` keeps Tune's own class, which waits
for every trial to reach each perturbation point, final reports included.
"""

from __future__ import annotations

from typing import Any, Dict

from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

from raytrain_events.ray import _compat

__all__ = ["EndAwarePBT"]


class EndAwarePBT(PopulationBasedTraining):
    """`PopulationBasedTraining` that neither copies into nor out of a trial at or after its final report."""

    def on_trial_result(self, tune_controller: Any, trial: Any, result: Dict[str, Any]) -> str:
        if result.get("final"):
            _compat.pbt_retire_trial(self, trial)
            return TrialScheduler.CONTINUE
        return super().on_trial_result(tune_controller, trial, result)
