"""Prediction: run a dataloader through the model with the ``PREDICT_*`` events, collecting outputs.

`Trainer.predict` calls `run_predict`; it works on a trained Trainer (after ``fit``) or on one that
only loaded a checkpoint (``CheckpointConfig(load_from=...)``). The model runs in eval mode under
``torch.no_grad`` and the Trainer's precision; outputs are moved to the CPU so that a long
prediction does not fill device memory. Each rank predicts its own data (no collective).

Under pipeline parallelism the stages run forward only (`raytrain_events.parallel.pipeline_eval`):
``state.outputs`` at ``PREDICT_AFTER_FORWARD`` is the model's outputs on the last stage's ranks (a
callback writing predictions out runs there) and None on the others; with ``return_outputs`` each
batch's outputs (on the CPU) are broadcast over the pipeline, so every rank returns its pipeline's.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Union

import torch

from raytrain_events.core.data_spec import DataSpec, ensure_data_spec
from raytrain_events.core.event import Event
from raytrain_events.parallel.pipeline import pipeline_of
from raytrain_events.parallel.pipeline_eval import forward_only, share_from_last
from raytrain_events.trainer._batch import device_batches
from raytrain_events.trainer.evaluation import EvaluationHost

__all__ = ["run_predict", "to_cpu"]


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def run_predict(
    host: EvaluationHost,
    dataloader: Union[Iterable[Any], DataSpec],
    subset_num_batches: int = -1,
    return_outputs: bool = True,
) -> List[Any]:
    """``model(batch)`` for each batch (the first ``subset_num_batches`` only, unless -1).

    Fires PREDICT_START, then per batch PREDICT_BATCH_START, PREDICT_BEFORE_FORWARD,
    PREDICT_AFTER_FORWARD (``state.outputs`` holds the outputs; a callback may write them out),
    PREDICT_BATCH_END, and finally PREDICT_END. Returns the outputs (on the CPU) when
    ``return_outputs``, else an empty list.
    """
    if not isinstance(subset_num_batches, int) or subset_num_batches == 0 or subset_num_batches < -1:
        raise ValueError(f"subset_num_batches={subset_num_batches!r} must be a positive int, or -1 for all batches.")
    state, engine, device = host.state, host.engine, host.device
    spec = ensure_data_spec(dataloader, "predict(dataloader)")
    model = state.model
    pipeline = pipeline_of(model)  # pipeline parallelism: the stages forward only, the outputs on the last
    was_training = model.training
    saved_batch, saved_outputs = state.batch, state.outputs
    outputs: List[Any] = []
    model.eval()
    try:
        engine.run_event(Event.PREDICT_START)
        with torch.no_grad():
            for batch in device_batches(spec, device, subset_num_batches):
                state.batch = batch
                engine.run_event(Event.PREDICT_BATCH_START)
                engine.run_event(Event.PREDICT_BEFORE_FORWARD)
                if pipeline is not None:
                    state.outputs = forward_only(pipeline, state.batch, spec, host.autocast())
                else:
                    with host.autocast():
                        state.outputs = model(state.batch)
                engine.run_event(Event.PREDICT_AFTER_FORWARD)
                if return_outputs:
                    output = to_cpu(state.outputs)
                    outputs.append(output if pipeline is None else share_from_last(pipeline, output))
                engine.run_event(Event.PREDICT_BATCH_END)
        engine.run_event(Event.PREDICT_END)
    finally:
        model.train(was_training)
        state.batch, state.outputs = saved_batch, saved_outputs
    return outputs
