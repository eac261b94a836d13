"""The event-driven training loop (one process; the same code runs inside Ray workers).

Files:

* ``_batch.py``: Small helpers the loop uses per batch: device moves, loss reduction, model checks.
* ``_setup.py``: Trainer set-up helpers: the train inputs checked (or absent, for eval/predict
  only), LR schedulers from torch objects or `State` functions, epoch hand-off to loaders, and the
  duration of a further ``fit``.
* ``arguments.py``: `Trainer`'s arguments checked before any work starts: each wrong input fails
  with its problem and fix.
* ``compiling.py``: ``torch.compile`` for the train model: ``Trainer(compile=True)`` or a dict of
  `torch.compile` options.
* ``counters.py``: `BatchCounters`: sum the loop's per-batch integers across ranks without a
  collective of their own.
* ``epoch_start.py``: `epoch_iterator`: where an epoch's train data starts, including mid-epoch
  after a resume.
* ``evaluation.py``: Evaluation: run each evaluator's data through the model and compute its
  metrics.
* ``forward_backward.py``: `ForwardBackward`: one batch's forward, loss and backward over its
  microbatches, with their events (the loop's step, and what auto microbatching retries).
* ``microbatching.py``: Auto microbatching (``grad_accum="auto"``): on a device out-of-memory
  error, retry the batch in more pieces.
* ``options.py``: `LoopOptions`: the one definition of the training loop's options, shared by
  `Trainer` and `RunSpec`.
* ``predict.py``: Prediction: run a dataloader through the model with the ``PREDICT_*`` events,
  collecting outputs.
* ``seed.py``: `seed_everything`: the one place that seeds Python's, torch's and numpy's global
  RNGs.
* ``stepping.py``: The optimizer step of a batch, with closures for optimizers that re-evaluate the
  loss (SAM).
* ``trainer.py``: `Trainer`: the event-driven training loop, in one process.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:
    from raytrain_events.trainer.evaluation import Evaluator
    from raytrain_events.trainer.options import LoopOptions
    from raytrain_events.trainer.seed import seed_everything
    from raytrain_events.trainer.trainer import Trainer

__all__ = ["Evaluator", "LoopOptions", "Trainer", "seed_everything"]

# Loaded on first use: `RunSpec` (ray/spec.py) reads `options.py`, and Ray Train's controller unpickles what
# names it at every fit; an eager `Trainer` here imported torch, the loop and every algorithm into it.
_LAZY = {
    "Evaluator": "raytrain_events.trainer.evaluation",
    "LoopOptions": "raytrain_events.trainer.options",
    "seed_everything": "raytrain_events.trainer.seed",
    "Trainer": "raytrain_events.trainer.trainer",
}

__getattr__ = lazy_names(__name__, _LAZY, globals())
