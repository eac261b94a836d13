"""`ForwardBackward`: one batch's forward, loss and backward over its microbatches, with their events.

The loop's step (``trainer.py``) asks it for a batch's gradients: in one call for one microbatch, or over
``grad_accum`` microbatches, each weighted by its share of the batch's samples so the accumulated gradient is the
full batch's mean, with only the last one reducing gradients. Auto microbatching (``microbatching.py``) calls its
``accumulate`` again with more microbatches after an OOM. It is built with what it works with: the `State`, the
`Engine`, the model it trains (the DDP/FSDP wrapper), the `Parallel` (no_sync, context parallelism's split and
loss), the train `DataSpec` and the per-batch `Counters` that may ride on the backward.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from raytrain_events.core.event import Event
from raytrain_events.trainer._batch import total_loss

if TYPE_CHECKING:
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.core.engine import Engine
    from raytrain_events.core.state import State
    from raytrain_events.dist import Dist
    from raytrain_events.parallel.wrap import Parallel
    from raytrain_events.trainer.counters import Counters

__all__ = ["ForwardBackward"]

_NULL_CONTEXT = contextlib.nullcontext()  # reusable and reentrant: no allocation per microbatch
# The per-microbatch events as module constants (a global lookup, not an attribute lookup on Event, per use).
_BEFORE_FORWARD, _AFTER_FORWARD = Event.BEFORE_FORWARD, Event.AFTER_FORWARD
_BEFORE_LOSS, _AFTER_LOSS = Event.BEFORE_LOSS, Event.AFTER_LOSS
_BEFORE_BACKWARD, _AFTER_BACKWARD = Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD


class ForwardBackward:
    """Forward, loss and backward of ``state.batch``, in one or several microbatches; sets ``state.loss``."""

    def __init__(  # noqa: PLR0913 (keyword-only: the loop's pieces it works with)
        self,
        *,
        state: State,
        engine: Engine,
        train_model: Any,
        parallel: Parallel,
        dist: Dist,
        train_spec: Optional[DataSpec],
        counters: Counters,
    ) -> None:
        self.state, self.engine, self.train_model = state, engine, train_model
        self.parallel, self.dist, self.train_spec, self.counters = parallel, dist, train_spec, counters

    def accumulate(
        self,
        grad_accum: int,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> None:
        """Forward, loss and backward of ``state.batch`` in ``grad_accum`` microbatches; sets ``state.loss``."""
        state = self.state
        full_batch = state.batch
        spec = self.train_spec
        assert spec is not None  # fit checked (check_can_fit)
        microbatches = [full_batch] if grad_accum == 1 else spec.split_batch(full_batch, grad_accum)
        if len(microbatches) == 1:
            state.loss = self.one(microbatches[0], 0, active, autocast, create_graph).detach()
        else:
            total_samples, last = state.batch_num_samples, len(microbatches) - 1
            no_sync = self.parallel.no_sync if self.dist.is_distributed else None
            accumulated: Any = None
            for index, microbatch in enumerate(microbatches):
                # Only the last microbatch reduces gradients (under DDP it also carries the counters).
                with no_sync(self.train_model) if (no_sync is not None and index < last) else _NULL_CONTEXT:
                    loss = self.one(microbatch, total_samples, active, autocast, create_graph)
                accumulated = loss.detach() if accumulated is None else accumulated + loss.detach()
            state.batch = full_batch
            state.loss = accumulated

    def one(
        self,
        microbatch: Any,
        total_samples: int,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> torch.Tensor:
        """One microbatch's forward, loss and backward with their events; returns the loss it backpropagated.

        With ``total_samples`` (several microbatches) the loss is weighted by the microbatch's share
        of the batch's samples, so the accumulated gradient is the full batch's mean.
        """
        state, engine = self.state, self.engine
        state.batch = self.parallel.split(microbatch)  # context parallelism: this rank's part of the sequence
        if active[_BEFORE_FORWARD]:
            engine.run_event(_BEFORE_FORWARD)
        if autocast is None:
            state.outputs = self.train_model(state.batch)
        else:
            with autocast:
                state.outputs = self.train_model(state.batch)
        if active[_AFTER_FORWARD]:
            engine.run_event(_AFTER_FORWARD)
        if active[_BEFORE_LOSS]:
            engine.run_event(_BEFORE_LOSS)
        if autocast is None:
            state.loss = state.model.loss(state.outputs, state.batch)
        else:
            with autocast:
                state.loss = state.model.loss(state.outputs, state.batch)
        if active[_AFTER_LOSS]:
            engine.run_event(_AFTER_LOSS)
        if active[_BEFORE_BACKWARD]:
            engine.run_event(_BEFORE_BACKWARD)
        loss: torch.Tensor = state.loss
        if type(loss) is not torch.Tensor:  # a dict/tuple of losses, or a tensor subclass
            loss = total_loss(loss)
        if total_samples and self.train_spec is not None:  # fit checked train_spec (check_can_fit)
            loss = loss * (self.train_spec.get_num_samples_in_batch(state.batch) / total_samples)
        scaler, counters = state.scaler, self.counters
        backward_loss = loss if scaler is None else scaler.scale(loss)
        if counters.on_gradients:  # under DDP the batch's counters ride on this backward (counters.py)
            counters.carry(backward_loss).backward(create_graph=create_graph)
            counters.after_backward()
        else:
            backward_loss.backward(create_graph=create_graph)
        if active[_AFTER_BACKWARD]:
            engine.run_event(_AFTER_BACKWARD)
        return self.parallel.whole_loss(loss)  # CP: the model's loss (its group's mean), not this rank's part
