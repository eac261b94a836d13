"""Evaluation: run each evaluator's data through the model and compute its metrics.

Each `Evaluator` may have its own ``eval_interval`` (else the Trainer's) and ``subset_num_batches``
(only the first N batches: cheap, frequent checks beside rare full evaluations). Metrics are
logged as ``metrics/<label>/<name>``.

Metrics are torchmetrics objects from ``model.get_metrics(is_train=False)``; with several ranks
their ``compute()`` synchronizes across the process group, so every rank logs the global value
(a tensor-parallel model's over one rank per tensor group, which all see the same batches).

Under pipeline parallelism the stages run forward only (`raytrain_events.parallel.pipeline_eval`):
``state.outputs`` at ``EVAL_AFTER_FORWARD`` is the model's outputs on the last stage's ranks and None
on the others; the metrics are updated and computed on the last stage (over its data-parallel ranks)
and shared over the pipeline, so every rank returns and logs the same values.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Union

import torch

from raytrain_events.core.data_spec import DataSpec, ensure_data_spec
from raytrain_events.core.event import Event
from raytrain_events.parallel.pipeline import pipeline_of
from raytrain_events.parallel.pipeline_eval import cpu_values, forward_only, share_from_last
from raytrain_events.parallel.tensor_parallel import metric_group
from raytrain_events.trainer._batch import device_batches

if TYPE_CHECKING:
    from raytrain_events.core.engine import Engine
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["Evaluator", "EvaluationHost", "ensure_evaluators", "run_evaluation"]


class Evaluator:
    """A named eval dataset, which of the model's metrics to compute on it, how often and on how much.

    Example::

        Evaluator(label="val_quick", dataloader=val, eval_interval="100ba", subset_num_batches=5)
        Evaluator(label="val", dataloader=val, eval_interval="1ep")

    Args:
        eval_interval: when to run during `Trainer.fit` (a `Time`, like ``"100ba"``, or
            ``fn(state, event) -> bool``); None: the Trainer's ``eval_interval``.
        subset_num_batches: evaluate on only the first this many batches; -1: all of them.
    """

    def __init__(
        self,
        *,
        label: str,
        dataloader: Union[Iterable[Any], DataSpec],
        metric_names: Optional[Sequence[str]] = None,
        eval_interval: Any = None,
        subset_num_batches: int = -1,
    ):
        if not label or "/" in label:
            raise ValueError(
                f"Evaluator label={label!r} must be a non-empty name without '/' (metrics/<label>/<name>)."
            )
        if not isinstance(subset_num_batches, int) or subset_num_batches == 0 or subset_num_batches < -1:
            raise ValueError(
                f"subset_num_batches={subset_num_batches!r} must be a positive int, or -1 for all batches."
            )
        self.label = label
        self.dataloader = ensure_data_spec(dataloader, f"eval_dataloader ({label!r})")
        self.metric_names = list(metric_names) if metric_names is not None else None
        self.eval_interval = eval_interval
        self.subset_num_batches = subset_num_batches


def ensure_evaluators(eval_dataloader: Any) -> List[Evaluator]:
    """Accept None, one dataloader, an `Evaluator`, a list of them, or a ``{label: dataloader}`` dict."""
    if eval_dataloader is None:
        return []
    if isinstance(eval_dataloader, Evaluator):
        return [eval_dataloader]
    if isinstance(eval_dataloader, Mapping):
        return [v if isinstance(v, Evaluator) else Evaluator(label=k, dataloader=v) for k, v in eval_dataloader.items()]
    if (
        isinstance(eval_dataloader, (list, tuple))
        and eval_dataloader
        and all(isinstance(e, Evaluator) for e in eval_dataloader)
    ):
        return list(eval_dataloader)
    return [Evaluator(label="eval", dataloader=eval_dataloader)]


def _fresh_metrics(model: Any, names: Optional[List[str]]) -> Dict[str, Any]:
    get_metrics = getattr(model, "get_metrics", None)
    if get_metrics is None:
        return {}
    metrics = dict(get_metrics(is_train=False))
    if names is not None:
        unknown = sorted(set(names) - set(metrics))
        if unknown:
            raise ValueError(
                f"Evaluator asks for metrics {unknown} the model does not define; it has {sorted(metrics)}."
            )
        metrics = {k: metrics[k] for k in names}
    out = {}
    for name, metric in metrics.items():
        metric = copy.deepcopy(metric)
        metric.reset()
        out[name] = metric
    return out


class EvaluationHost(Protocol):
    """What evaluation needs from the loop that runs it (a `Trainer` is one)."""

    @property
    def state(self) -> State: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def logger(self) -> Logger: ...

    @property
    def device(self) -> torch.device: ...

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision context the eval forward runs in."""
        ...


def run_evaluation(
    host: EvaluationHost,
    evaluators: Optional[Sequence[Evaluator]] = None,
    subset_num_batches: Optional[int] = None,
    log: bool = True,
) -> Dict[str, Any]:
    """Evaluate on ``evaluators`` (default: all of ``state.evaluators``), firing the EVAL_* events.

    Returns the computed metrics ``{"metrics/<label>/<name>": value}``, logged too when ``log``.
    ``subset_num_batches`` (when given and not -1) overrides each evaluator's own.
    """
    state, logger = host.state, host.logger
    model = state.model
    was_training = model.training
    train_batch, train_outputs = state.batch, state.outputs
    results: Dict[str, Any] = {}
    pipeline = pipeline_of(model)  # pipeline parallelism: the stages forward only, metrics on the last
    group = metric_group(model) if pipeline is None else pipeline.data_group
    model.eval()
    try:
        for evaluator in state.evaluators if evaluators is None else evaluators:
            limit = evaluator.subset_num_batches if subset_num_batches in (None, -1) else subset_num_batches
            values = _evaluate(host, evaluator, limit, pipeline, group)
            if values and log:
                logger.log_metrics(values, step=state.step)
            results.update(values)
            host.engine.run_event(Event.EVAL_END)
    finally:
        model.train(was_training)
        state.batch, state.outputs = train_batch, train_outputs
    return results


def _evaluate(host: EvaluationHost, evaluator: Evaluator, limit: int, pipeline: Any, group: Any) -> Dict[str, Any]:
    """One evaluator from EVAL_START to its metrics' values (``{"metrics/<label>/<name>": value}``, on every rank of
    a pipeline): fresh metrics on the device, synced over ``group``, updated batch by batch."""
    state, engine, device, model = host.state, host.engine, host.device, host.state.model
    metrics = _fresh_metrics(model, evaluator.metric_names)
    for metric in metrics.values():
        metric.to(device)
        if group is not None:
            metric.process_group = group
    state.eval_metrics[evaluator.label] = metrics
    engine.run_event(Event.EVAL_START)
    spec = evaluator.dataloader
    update_metric = getattr(model, "update_metric", None)
    with torch.no_grad():
        for batch in device_batches(spec, device, limit):
            state.batch = batch
            engine.run_event(Event.EVAL_BATCH_START)
            engine.run_event(Event.EVAL_BEFORE_FORWARD)
            state.outputs = _forward(host, spec, pipeline)
            engine.run_event(Event.EVAL_AFTER_FORWARD)
            if update_metric is not None and (pipeline is None or pipeline.has_last):
                for metric in metrics.values():
                    update_metric(state.batch, state.outputs, metric)
            engine.run_event(Event.EVAL_BATCH_END)
    values = {}
    if pipeline is None or pipeline.has_last:
        values = {f"metrics/{evaluator.label}/{name}": metric.compute() for name, metric in metrics.items()}
    if pipeline is not None:  # the last stage's values on every rank of the pipeline
        values = share_from_last(pipeline, cpu_values(values))
    return values


def _forward(host: EvaluationHost, spec: Any, pipeline: Any) -> Any:
    """The model's eval outputs for ``state.batch``: ``eval_forward`` when the model has one, else its forward;
    under pipeline parallelism the stages' forward (None off the last stage)."""
    state, model = host.state, host.state.model
    eval_forward = getattr(model, "eval_forward", None)
    if pipeline is not None:  # None off the last stage; eval_forward takes the model's outputs
        outputs = forward_only(pipeline, state.batch, spec, host.autocast())
        return eval_forward(state.batch, outputs) if outputs is not None and eval_forward is not None else outputs
    with host.autocast():
        return eval_forward(state.batch, None) if eval_forward is not None else model(state.batch)
