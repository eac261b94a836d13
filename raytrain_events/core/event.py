"""Training loop events: the fixed points where algorithms and callbacks run.

The order below is the contract (Composer's loop pseudocode); `Trainer` fires them in this order::

    # <INIT>
    # <AFTER_LOAD>
    # <FIT_START>
    for epoch in range(NUM_EPOCHS):
        # <EPOCH_START>
        while True:
            # <BEFORE_DATALOADER>
            batch = next(dataloader)
            if batch is None:
                break
            # <AFTER_DATALOADER>
            # <BATCH_START>
            # <BEFORE_TRAIN_BATCH>
            for microbatch in batch.split(grad_accum):
                # <BEFORE_FORWARD>
                outputs = model(batch)
                # <AFTER_FORWARD>
                # <BEFORE_LOSS>
                loss = model.loss(outputs, batch)
                # <AFTER_LOSS>
                # <BEFORE_BACKWARD>
                loss.backward()
                # <AFTER_BACKWARD>
            # <AFTER_TRAIN_BATCH>
            optimizer.step()
            # <BATCH_END>
            if should_eval(batch=True):
                # <EVAL_START> ... <EVAL_BATCH_START> <EVAL_BEFORE_FORWARD>
                #                  <EVAL_AFTER_FORWARD> <EVAL_BATCH_END> ... <EVAL_END>
            # <BATCH_CHECKPOINT>
        # <EPOCH_END>
        if should_eval(batch=False):
            # <EVAL_START> ... <EVAL_END>
        # <EPOCH_CHECKPOINT>
    # <FIT_END>

`Trainer.eval()` fires the ``EVAL_*`` events on their own, and `Trainer.predict()` fires::

    # <PREDICT_START>
    for batch in dataloader:
        # <PREDICT_BATCH_START> <PREDICT_BEFORE_FORWARD>
        outputs = model(batch)
        # <PREDICT_AFTER_FORWARD> <PREDICT_BATCH_END>
    # <PREDICT_END>
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Event"]


class Event(str, Enum):
    """An event in the training loop; ``event.value == event.name.lower()``.

    >>> Event.BATCH_END.value
    'batch_end'
    >>> Event.AFTER_LOSS.is_after_event
    True
    """

    INIT = "init"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    FIT_END = "fit_end"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    def __str__(self) -> str:
        return self.value

    @property
    def is_before_event(self) -> bool:
        """True for ``*_START`` and ``BEFORE_*`` events (Composer's grouping)."""
        return self in _BEFORE_EVENTS

    @property
    def is_after_event(self) -> bool:
        """True for ``*_END`` and ``AFTER_*`` events; algorithms run in reverse order on these."""
        return self in _AFTER_EVENTS

    @property
    def is_eval(self) -> bool:
        """True for the ``EVAL_*`` events."""
        return self.value.startswith("eval_")

    @property
    def is_predict(self) -> bool:
        """True for the ``PREDICT_*`` events (fired by `Trainer.predict`)."""
        return self.value.startswith("predict_")


# As in Composer: each *_START / BEFORE_* event pairs with an *_END / AFTER_* event, and on the
# latter algorithms run first-in-last-out so each can undo its own change. AFTER_LOAD has no
# BEFORE_LOAD here but is an AFTER_* event all the same (Composer counts it as one too).
_BEFORE_EVENTS = frozenset(
    {
        Event.FIT_START,
        Event.EPOCH_START,
        Event.BEFORE_DATALOADER,
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        Event.BEFORE_FORWARD,
        Event.BEFORE_LOSS,
        Event.BEFORE_BACKWARD,
        Event.EVAL_START,
        Event.EVAL_BATCH_START,
        Event.EVAL_BEFORE_FORWARD,
        Event.PREDICT_START,
        Event.PREDICT_BATCH_START,
        Event.PREDICT_BEFORE_FORWARD,
    }
)
_AFTER_EVENTS = frozenset(
    {
        Event.AFTER_LOAD,
        Event.FIT_END,
        Event.EPOCH_END,
        Event.BATCH_END,
        Event.AFTER_DATALOADER,
        Event.AFTER_TRAIN_BATCH,
        Event.AFTER_FORWARD,
        Event.AFTER_LOSS,
        Event.AFTER_BACKWARD,
        Event.EVAL_END,
        Event.EVAL_BATCH_END,
        Event.EVAL_AFTER_FORWARD,
        Event.PREDICT_END,
        Event.PREDICT_BATCH_END,
        Event.PREDICT_AFTER_FORWARD,
    }
)
