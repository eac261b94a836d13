"""Ray Tune sweeps over algorithm sets and hyperparameters: ``from raytrain_events.tune import sweep``.

See `raytrain_events.ray.tune` for the details; this module only re-exports its public names.
"""

from raytrain_events.ray.tune import (
    TIME_ATTRS,
    TRIAL_RECORD,
    TRIAL_RUN_NAME,
    SweepResult,
    algorithm_set_label,
    algorithm_sets_grid,
    sweep,
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
