"""Training algorithms (Composer's method library), each a small `Algorithm` in its own file.

Use them as instances or build them by name (`build_algorithm`, `build_algorithms`)::

    from raytrain_events.algorithms import LabelSmoothing, MixUp, build_algorithms

    Trainer(..., algorithms=[MixUp(alpha=0.2), LabelSmoothing(0.1)])
    Trainer(..., algorithms=build_algorithms(["mixup", {"name": "label_smoothing", "smoothing": 0.1}]))

Ordering (the `Engine`'s rules)
-------------------------------
At each event the algorithms whose ``match`` is true run in the order of the ``algorithms``
list on ``BEFORE_*`` and ``*_START`` events (and on events that are neither: ``INIT``,
``AFTER_LOAD``, ``*_CHECKPOINT``), and in *reverse* order on ``AFTER_*`` and ``*_END`` events
(those with ``Event.is_after_event``, which include ``AFTER_DATALOADER``; so two algorithms that
both transform the batch at ``AFTER_DATALOADER`` run last-listed first). So the first algorithm to change
something is the last to see it come back, and every algorithm that replaces a value at a
``BEFORE_*`` event and restores it at the matching ``AFTER_*`` event restores exactly what it
replaced. Pass ``algorithm_passes=`` to the Trainer to change the order (for example
`raytrain_events.core.engine.sort_by_priority`).

Which event each algorithm uses:

=====================  ==================================================================
algorithm              events
=====================  ==================================================================
ChannelsLast           INIT (model to NHWC)
Float8Training         INIT (Linear -> torchao Float8Linear); BATCH_END (FSDP float8 scales)
StochasticDepth        INIT (hooks on marked branches); BATCH_START if ``drop_warmup``
SeqLengthWarmup        AFTER_DATALOADER (before samples and tokens are counted)
ProgressiveResizing    AFTER_DATALOADER
MixUp, CutMix          BEFORE_FORWARD (inputs, per microbatch); BEFORE_LOSS / AFTER_LOSS (targets)
LabelSmoothing         BEFORE_LOSS (smooth targets); AFTER_LOSS (restore them)
GradientClipping       AFTER_TRAIN_BATCH (gradients already unscaled)
EMA                    FIT_START; BATCH_END or EPOCH_END (update); EVAL_START / EVAL_END (swap)
LayerFreezing          EPOCH_END (or BATCH_END); FIT_START after a resume
SWA                    EPOCH_END or BATCH_END (average); FIT_END (weights replaced by the average)
SAM                    INIT (optimizers wrapped; the step re-runs forward/backward in a closure)
=====================  ==================================================================

MixUp (or CutMix) with LabelSmoothing
-------------------------------------
Both change the targets only for the loss. Each converts the targets it finds to class
probabilities (integer labels become one-hot; probabilities are used as they are), changes
them, and restores what it found at ``AFTER_LOSS``. Both changes are affine maps that keep
probabilities summing to one, so they commute: ``algorithms=[MixUp(...), LabelSmoothing(s)]``
and ``[LabelSmoothing(s), MixUp(...)]`` both train against::

    (1 - s) * (lam * onehot(y) + (1 - lam) * onehot(y[perm])) + s / C

With ``MixUp(interpolate_loss=True)`` the loss (not the targets) is mixed at ``AFTER_LOSS``,
recomputing the loss on permuted targets; list LabelSmoothing *before* MixUp so that, with the
reversed order on ``AFTER_LOSS``, MixUp runs while the targets are still smoothed.

Algorithms with state (EMA, SWA, LayerFreezing) save it through ``state_dict`` and resume it
from checkpoints. ``SAM`` wraps the optimizers at INIT; the loop calls ``optimizer.step(closure)``
for it, re-running the batch's forward and backward inside the step.

Files:

* ``_batch.py``: Reading and replacing the inputs or targets of a batch without mutating the
  loader's objects.
* ``_mixing.py``: Shared machinery of MixUp and CutMix: mix inputs with a permutation, then mix the
  targets.
* ``channels_last.py``: `ChannelsLast`: store the model's 4-D weights in NHWC ("channels last")
  memory format.
* ``cutmix.py``: `CutMix`: paste a random box from another sample into each image, and mix labels
  by area.
* ``ema.py``: `EMA`: keep an exponential moving average of the weights and evaluate with it.
* ``float8.py``: `Float8Training`: train the model's Linear layers with float8 matmuls (torchao),
  on GPUs that have them.
* ``gradient_clipping.py``: `GradientClipping`: clip gradients by global norm or by value before
  the optimizer step.
* ``label_smoothing.py``: `LabelSmoothing`: train against ``(1 - s) * one_hot(y) + s / C`` instead
  of the hard label.
* ``layer_freezing.py``: `LayerFreezing`: progressively freeze the earliest layers once training is
  far enough along.
* ``mixup.py``: `MixUp`: train on convex combinations of pairs of samples and of their labels.
* ``progressive_resizing.py``: `ProgressiveResizing`: train on smaller images first and grow them
  to full size.
* ``registry.py``: Build algorithms by name, so configs can say ``"label_smoothing"`` instead of
  importing a class.
* ``sam.py``: `SAM`: sharpness-aware minimization (Foret et al., 2021), Composer's ``SAM``
  algorithm.
* ``seq_length_warmup.py``: `SeqLengthWarmup`: start language-model training on short sequences and
  grow them.
* ``stochastic_depth.py``: `StochasticDepth`: randomly drop the residual branches of blocks during
  training.
* ``swa.py``: `SWA`: stochastic weight averaging over the last part of training.
"""

from raytrain_events.algorithms.channels_last import ChannelsLast
from raytrain_events.algorithms.cutmix import CutMix
from raytrain_events.algorithms.ema import EMA
from raytrain_events.algorithms.float8 import Float8Training
from raytrain_events.algorithms.gradient_clipping import GradientClipping
from raytrain_events.algorithms.label_smoothing import LabelSmoothing, smooth_labels
from raytrain_events.algorithms.layer_freezing import LayerFreezing
from raytrain_events.algorithms.mixup import MixUp
from raytrain_events.algorithms.progressive_resizing import ProgressiveResizing
from raytrain_events.algorithms.registry import (
    available_algorithms,
    build_algorithm,
    build_algorithms,
    register_algorithm,
)
from raytrain_events.algorithms.sam import SAM, SAMOptimizer
from raytrain_events.algorithms.seq_length_warmup import SeqLengthWarmup
from raytrain_events.algorithms.stochastic_depth import StochasticDepth, mark_residual_branch
from raytrain_events.algorithms.swa import SWA

__all__ = [
    "ChannelsLast",
    "Float8Training",
    "CutMix",
    "EMA",
    "GradientClipping",
    "LabelSmoothing",
    "LayerFreezing",
    "MixUp",
    "ProgressiveResizing",
    "SAM",
    "SAMOptimizer",
    "SWA",
    "SeqLengthWarmup",
    "StochasticDepth",
    "available_algorithms",
    "build_algorithm",
    "build_algorithms",
    "mark_residual_branch",
    "register_algorithm",
    "smooth_labels",
]
