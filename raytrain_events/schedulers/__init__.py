"""Learning-rate schedules as functions of the global `Timestamp` (Composer's ``composer.optim.scheduler``).

Each schedule is a callable ``scheduler(state) -> multiplier``; the Trainer wraps it in a
``LambdaLR`` stepped after every batch, so the learning rate of the next batch is
``base_lr * scheduler(state)``. Time arguments are `Time` values or strings in any unit:
``"0.05dur"`` (a fraction of ``max_duration``), ``"2ep"``, ``"100ba"``, ``"5e4sp"``, ``"1e6tok"``.
Because the timestamp counts global batches, samples and tokens, a schedule means the same on
1 or 64 workers.

Example::

    from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler

    Trainer(..., max_duration="10ep", schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.05dur"))

Any ``fn(state) -> float`` works as a schedule too.

Files:

* ``_convert.py``: Turning a schedule's Time arguments into counts the global `Timestamp` can be
  compared with.
* ``schedulers.py``: Composer's stateless LR schedules: each is ``scheduler(state) -> multiplier``
  of the global Timestamp.
* ``warmup.py``: Composer's ``*WithWarmupScheduler`` schedules: a linear warmup, then the main
  schedule.
"""

from raytrain_events.schedulers.schedulers import (
    ConstantScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    ExponentialScheduler,
    LinearScheduler,
    MultiStepScheduler,
    PolynomialScheduler,
    Scheduler,
    StepScheduler,
    cosine_anneal,
)
from raytrain_events.schedulers.warmup import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearWithWarmupScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialWithWarmupScheduler,
)

__all__ = [
    "Scheduler",
    "ConstantScheduler",
    "LinearScheduler",
    "StepScheduler",
    "MultiStepScheduler",
    "ExponentialScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "PolynomialScheduler",
    "ConstantWithWarmupScheduler",
    "LinearWithWarmupScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "PolynomialWithWarmupScheduler",
    "MultiStepWithWarmupScheduler",
    "cosine_anneal",
]
