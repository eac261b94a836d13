"""`Trainer`: the event-driven training loop, in one process.

It fires the events of `raytrain_events.core.event` in the documented order, keeps a global
`Timestamp` (per-rank sample and token counts summed across ranks once per batch), and stops
at ``max_duration`` in any unit. Distributed training goes through a small `Dist` interface,
so the same loop runs locally, in tests, and inside each Ray Train worker.

Per step the loop reads nothing back from the device: the loss stays a tensor in
``state.loss`` until a callback asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.callback import Callback
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.engine import AlgorithmPass, Engine
from raytrain_events.core.event import Event
from raytrain_events.core.interval import is_done
from raytrain_events.core.logger import Logger, LoggerDestination
from raytrain_events.core.precision import Precision, autocast_context
from raytrain_events.core.state import State
from raytrain_events.core.time import Time, TimeUnit
from raytrain_events.dist import Dist, default_dist
from raytrain_events.parallel.oom_agreement import check_fsdp_config
from raytrain_events.parallel.wrap import Parallel
from raytrain_events.trainer._batch import check_model, move_to_device
from raytrain_events.trainer._setup import (
    check_can_fit,
    check_flags_agree,
    eval_intervals,
    new_state,
    pipeline_step,
    set_duration,
    train_inputs,
    wrap_for_training,
)
from raytrain_events.trainer.arguments import agreed_run_name, check_arguments
from raytrain_events.trainer.compiling import compile_model
from raytrain_events.trainer.epoch_start import epoch_iterator
from raytrain_events.trainer.evaluation import ensure_evaluators, run_evaluation
from raytrain_events.trainer.forward_backward import ForwardBackward
from raytrain_events.trainer.microbatching import AutoMicrobatching, auto_microbatching_of, batch_counters
from raytrain_events.trainer.options import LoopOptions
from raytrain_events.trainer.predict import run_predict
from raytrain_events.trainer.seed import seed_everything
from raytrain_events.trainer.stepping import step_optimizers

if TYPE_CHECKING:
    from raytrain_events.checkpoint.run.checkpointer import Checkpointer

__all__ = ["Trainer"]

# The per-batch events as module constants (a global lookup, not an attribute lookup on Event, per use).
_BEFORE_DATALOADER, _AFTER_DATALOADER, _BATCH_START = Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START
_BEFORE_TRAIN_BATCH, _AFTER_TRAIN_BATCH = Event.BEFORE_TRAIN_BATCH, Event.AFTER_TRAIN_BATCH
_BATCH_END, _BATCH_CHECKPOINT = Event.BATCH_END, Event.BATCH_CHECKPOINT
_timedelta = datetime.timedelta  # timedelta(days, seconds): cheaper than seconds=, per batch
_FP32 = Precision.FP32  # per batch `Precision.FP32` is an unspecialized lookup (3.11: EnumType.__getattr__)


def _parallel(model: torch.nn.Module, options: LoopOptions, algorithms: Sequence[Algorithm]) -> Parallel:
    """How ``model`` is spread over the ranks (``parallelism``: "ddp", the default, "fsdp" or an FSDPConfig, ...),
    checked against the algorithms and, under ``grad_accum="auto"``, the FSDP config."""
    parallel = Parallel(options.parallelism_spec, model)
    parallel.check(algorithms)
    if options.auto_microbatching and parallel.spec.fsdp is not None:
        check_fsdp_config(parallel.spec.fsdp)
    return parallel


class Trainer:
    """Train a model with algorithms and callbacks firing at every event.

    Example::

        trainer = Trainer(
            model=ClassifierModel(net, num_classes=10),
            train_dataloader=DataLoader(train_set, batch_size=64),
            eval_dataloader=DataLoader(test_set, batch_size=256),
            max_duration="3ep",
            optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
            algorithms=[LabelSmoothing(0.1)],
        )
        trainer.fit()

    The model follows Composer's protocol: ``forward(batch)``, ``loss(outputs, batch)``, and
    optionally ``eval_forward(batch, outputs)``, ``get_metrics(is_train)`` and
    ``update_metric(batch, outputs, metric)``.

    For ``eval()``/``predict()`` only, omit ``train_dataloader``, ``max_duration`` and ``optimizers``:
    ``Trainer(model=m, eval_dataloader=val, checkpoint=CheckpointConfig(load_from=url))`` loads the weights.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        train_dataloader: Union[Iterable[Any], DataSpec, None] = None,
        optimizers: Any = None,
        schedulers: Any = None,
        eval_dataloader: Any = None,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[LoggerDestination] = (),
        device: Union[str, torch.device, None] = None,
        dist: Optional[Dist] = None,
        run_name: Optional[str] = None,
        checkpoint: Any = None,
        algorithm_passes: Optional[Sequence[AlgorithmPass]] = None,
        options: Optional[LoopOptions] = None,
        **loop_options: Any,
    ) -> None:
        """``loop_options``: the `LoopOptions` fields as keywords (``max_duration``, ``eval_interval``,
        ``grad_accum``, ``precision``, ``parallelism``, ``compile``, ``seed``, ``config``), each
        with its default and meaning there; they replace those of ``options`` when both are given.
        ``run_name``: one folder name; None gives a fresh ``run-<date>-<time>-<hex>`` (see `fresh_run_name`)."""
        check_model(model)
        self.options = opts = LoopOptions.build(options, loop_options)
        # None (with max_duration and optimizers possibly None too): a Trainer for eval()/predict() only.
        self.train_spec, duration = train_inputs(train_dataloader, opts.max_duration, optimizers)
        compile_kwargs, auto_microbatching = opts.compile_kwargs, opts.auto_microbatching
        algorithms, callbacks, loggers = check_arguments(model, optimizers, device, (algorithms, callbacks, loggers))

        self.parallel = _parallel(model, opts, algorithms)
        self.dist = dist if dist is not None else default_dist(torch.device(device) if device is not None else None)
        self.device = torch.device(device) if device is not None else self.dist.device
        self.config = opts.config
        run_name = agreed_run_name(run_name, self.dist, checkpoint)
        if opts.seed is not None:
            seed_everything(opts.seed + self.dist.rank)
        self.parallel.place(model, self.device)  # not a meta-device model: that one is materialised in wrap
        self.state = new_state(
            model=model,
            duration=duration,
            train_spec=self.train_spec,
            eval_dataloader=eval_dataloader,
            options=opts,
            optimizers=optimizers,
            schedulers=schedulers,
            algorithms=algorithms,
            callbacks=callbacks,
            dist=self.dist,
            device=self.device,
            run_name=run_name,
        )
        counts_tokens = self.train_spec is not None and self.train_spec.counts_tokens
        self._eval_intervals = eval_intervals(opts.eval_interval, self.state.evaluators, duration, counts_tokens)
        self.logger = Logger(loggers if self.dist.rank == 0 else ())
        self.engine = Engine(state=self.state, logger=self.logger, algorithm_passes=algorithm_passes)
        self._checkpointer: Optional[Checkpointer] = None
        self._fitted = False
        self._start(compile_kwargs, auto_microbatching, checkpoint)

    def _start(self, compile_kwargs: Optional[Dict[str, Any]], auto_microbatching: bool, checkpoint: Any) -> None:
        """The loop's set-up events: INIT (where algorithms and callbacks may change the model), the wrap for
        training, the checkpoint's load, then AFTER_LOAD."""
        self.engine.run_event(Event.INIT)
        self.engine.refresh()  # algorithms or callbacks may have been added at INIT
        self._wrap(compile_kwargs, auto_microbatching)
        if checkpoint is not None:
            self._attach_checkpoint(checkpoint)
        self.engine.run_event(Event.AFTER_LOAD)

    def _wrap(self, compile_kwargs: Optional[Dict[str, Any]], auto_microbatching: bool) -> None:
        """After INIT's model changes: compile, wrap (DDP/FSDP/TP/CP/PP), and the per-batch counters."""
        self.parallel.check(self.state.algorithms)
        if compile_kwargs is not None:  # after INIT's model changes, before DDP/FSDP wraps the model
            compile_model(self.state.model, compile_kwargs)
        # The counters ride on DDP's gradient all-reduce, except under auto microbatching (see counters.py).
        wrapped, self._ddp = wrap_for_training(self, counted=not auto_microbatching)
        self._counters, self._train_model = batch_counters(
            state=self.state, dist=self.dist, ddp=self._ddp, train_model=wrapped, deferred=auto_microbatching
        )
        self._step = ForwardBackward(
            state=self.state,
            engine=self.engine,
            train_model=self._train_model,
            parallel=self.parallel,
            dist=self.dist,
            train_spec=self.train_spec,
            counters=self._counters,
        )
        self._auto: Optional[AutoMicrobatching] = None
        if auto_microbatching:
            self._auto = auto_microbatching_of(
                state=self.state,
                logger=self.logger,
                counters=self._counters,
                ddp=self._ddp,
                wrapped=wrapped,
                accumulate=self._step.accumulate,
            )
        self._pipeline = pipeline_step(self)  # pipeline parallelism: the schedule runs the batch (None without)
        if self._pipeline is not None:
            self._counters = self._pipeline.counters  # the model's loss rides on the per-batch sum

    def _attach_checkpoint(self, checkpoint: Any) -> None:
        """Checkpointing for a fit (resume, saves), or, for eval/predict only, the model loaded from it."""
        # why here: defers fsspec until this runs
        from raytrain_events.checkpoint.run.checkpointer import attach_checkpointing
        from raytrain_events.checkpoint.run.inference import load_for_inference

        if self.train_spec is None:  # eval/predict only: load the model, nothing to save
            load_for_inference(self, checkpoint)
        else:
            self._checkpointer = attach_checkpointing(self, checkpoint)

    # ------------------------------------------------------------ properties
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision context forward and loss run in."""
        return autocast_context(self.state.precision, self.device.type)

    # ------------------------------------------------------------------- fit
    def fit(self, duration: Union[str, int, Time[Any], None] = None, reset_time: bool = False) -> State:
        """Train until ``max_duration`` (or an early stop); returns the final `State`.

        As in Composer, a fitted Trainer can train on: ``fit(duration="2ep")`` trains two more epochs
        from where it stopped (the new ``max_duration``, in ``options`` too, is now + ``duration``); ``reset_time=True``
        starts the Timestamp at zero again (a new phase, e.g. fine-tuning), for ``duration`` or the
        old ``max_duration``. Callbacks and loggers are closed at the end of each fit and reopened.
        """
        check_can_fit(self.train_spec, self.state)  # a Trainer built for eval()/predict() only says what it lacks
        if self._fitted:
            if duration is None and not reset_time:
                raise RuntimeError(
                    "fit() already ran on this Trainer: pass fit(duration='1ep') to train for more, or "
                    "reset_time=True to start the Timestamp over."
                )
            self._reopen()
        if duration is not None or reset_time:
            set_duration(
                self.state, self.train_spec is not None and self.train_spec.counts_tokens, duration, reset_time
            )
            self.options = dataclasses.replace(self.options, max_duration=self.state.max_duration)
        self._fitted = True
        try:
            self._fit()
        except BaseException as exc:
            self.engine.run_exception(exc)
            raise
        finally:
            if self._checkpointer is not None:
                self._checkpointer.close()
            self.engine.close()
        return self.state

    def _reopen(self) -> None:
        """Before a further fit: the engine, loggers and checkpointer ready again, no stale stop request."""
        state = self.state
        state.stop_requested = state.stop_consistent = False
        state.stop_reason = None
        self.engine.reopen()
        if self._checkpointer is not None:
            self._checkpointer.reopen()

    def _fit(self) -> None:
        state, engine = self.state, self.engine
        state.model.train()
        engine.run_event(Event.FIT_START)
        check_flags_agree(self.state, self.dist)
        epoch_unit = state.max_duration is not None and state.max_duration.unit == TimeUnit.EPOCH
        while not (state.stop_requested and state.stop_consistent) and not is_done(state):
            engine.run_event(Event.EPOCH_START)
            finished_early = self._run_epoch()
            steps = state.steps_per_epoch
            if not finished_early or (steps is not None and state.timestamp.batch_in_epoch.value == steps):
                state.timestamp = state.timestamp.to_next_epoch()
                engine.run_event(Event.EPOCH_END)
                if state.evaluators:
                    self._evaluate_due(Event.EPOCH_END)
                engine.run_event(Event.EPOCH_CHECKPOINT)
            if not epoch_unit and finished_early:
                break
        engine.run_event(Event.FIT_END)

    def _run_epoch(self) -> bool:
        """One pass over the train data; True if it stopped before the data ran out. Each batch: `_next_batch`, the
        one sum across ranks started, `_train_batch`, the sum read, `_end_batch`."""
        state, engine, spec, counters = self.state, self.engine, self.train_spec, self._counters
        assert spec is not None  # fit checked (check_can_fit)
        resume_rng = self._checkpointer.take_resume_rng() if self._checkpointer is not None else None
        iterator, skip = epoch_iterator(spec.dataloader, state, resume_rng)
        agreement, perf_counter = state.agreement, time.perf_counter
        # One process (and no auto microbatching, whose counters agree per attempt): the sums are
        # this rank's values, so the batch needs no counter calls at all.
        single = self._auto is None and not self.dist.is_distributed
        batches, counts_data = 0, self.parallel.counts_data(state.rank, self.dist.world_size)
        while True:
            # Events nobody listens to are skipped: no algorithms, and no callback overrides them.
            active = engine.active_events()
            if (counted := self._next_batch(iterator, active, spec)) is None:
                break
            samples, tokens = counted
            # One sum per batch (riding on DDP's all-reduce where it can): counts, a stop, every agreement flag.
            local_stop = 1 if state.stop_requested and not state.stop_consistent else 0
            if single:  # the flags as asked before the batch, as the ranks' sum would have them (None: no change)
                flags = agreement.one_process_sums()
            else:
                counters.start([*(counted if counts_data else (0, 0)), local_stop, *agreement.local_values()])
            if active[_BATCH_START]:
                engine.run_event(_BATCH_START)
            start = perf_counter()
            self._train_batch(active)
            if single:
                if flags is not None:
                    agreement.set_sums(flags)
            else:
                sums = counters.wait()
                samples, tokens, local_stop = sums[0], sums[1], sums[2]
                if len(sums) > 3:
                    agreement.set_sums(sums[3:])
            batches += 1
            if self._end_batch(active, samples, tokens, local_stop, perf_counter() - start):
                return True
        if batches == 0 and skip == 0:
            raise RuntimeError(
                f"The train dataloader yielded no batches in epoch {state.epoch} on rank {state.rank}: "
                "check that the dataset (or this rank's shard) is not empty."
            )
        return False

    def _next_batch(self, iterator: Any, active: Mapping[Event, bool], spec: Any) -> Optional[Tuple[int, int]]:
        """The next batch into ``state.batch`` (on the device, transformed) and this rank's (samples, tokens) of it."""
        state, engine = self.state, self.engine
        if active[_BEFORE_DATALOADER]:
            engine.run_event(_BEFORE_DATALOADER)
        try:
            batch = next(iterator)
        except StopIteration:
            return None
        if self.device.type != "cpu":
            batch = move_to_device(batch, self.device)
        if spec.device_transforms is not None:
            batch = spec.device_transforms(batch)
        state.batch = batch
        if active[_AFTER_DATALOADER]:
            engine.run_event(_AFTER_DATALOADER)
        samples = spec.get_num_samples_in_batch(state.batch)
        tokens = spec.num_tokens_in_batch(state.batch) if spec.counts_tokens else 0
        if state.grad_accum > samples and self._auto is None:
            raise ValueError(
                f"grad_accum={state.grad_accum} is larger than the batch ({samples} samples on rank {state.rank}): "
                "lower grad_accum or raise the batch size."
            )
        state.batch_num_samples, state.batch_num_tokens = samples, tokens
        return samples, tokens

    def _end_batch(self, active: Mapping[Event, bool], samples: int, tokens: int, stop: int, seconds: float) -> bool:
        """After the step: a stop, the global counts and Timestamp, schedulers, end events, evals; whether to end."""
        state, engine = self.state, self.engine
        if stop:
            state.stop_requested = state.stop_consistent = True
        state.global_batch_num_samples, state.global_batch_num_tokens = samples, tokens
        state.timestamp = state.timestamp.to_next_batch(samples, tokens, _timedelta(0, seconds))  # (days, seconds)
        for scheduler in state.schedulers:
            scheduler.step()
        if active[_BATCH_END]:
            engine.run_event(_BATCH_END)
        if state.evaluators:
            self._evaluate_due(_BATCH_END)
        if active[_BATCH_CHECKPOINT]:
            engine.run_event(_BATCH_CHECKPOINT)
        return (state.stop_requested and state.stop_consistent) or is_done(state)

    def _train_batch(self, active: Mapping[Event, bool]) -> None:
        """Forward, loss and backward over ``grad_accum`` microbatches, then the optimizer step."""
        state, engine = self.state, self.engine
        scaler = state.scaler
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if active[_BEFORE_TRAIN_BATCH]:
            engine.run_event(_BEFORE_TRAIN_BATCH)
        create_graph = any(a.backwards_create_graph for a in state.algorithms) if state.algorithms else False
        # One context per batch, entered for each forward and loss (never nested); none for fp32.
        autocast = None if state.precision is _FP32 else self.autocast()
        if self._auto is None and state.grad_accum == 1 and self._pipeline is None:  # one microbatch, two calls less
            state.loss = self._step.one(state.batch, 0, active, autocast, create_graph).detach()
        else:
            self._forward_backward_batch(active, autocast, create_graph)
        if scaler is not None:
            for optimizer in state.optimizers:
                scaler.unscale_(optimizer)
        if active[_AFTER_TRAIN_BATCH]:
            engine.run_event(_AFTER_TRAIN_BATCH)
        step_optimizers(state, self._forward_backward_batch, active, autocast, create_graph)

    def _forward_backward_batch(
        self,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> None:
        """The batch's forward/backward (train step and closures); ``grad_accum="auto"`` retries on OOM."""
        if self._auto is not None:
            self._auto.accumulate(active, autocast, create_graph)
        elif self._pipeline is not None:
            self._pipeline.accumulate(active, autocast, create_graph)
        else:
            self._step.accumulate(self.state.grad_accum, active, autocast, create_graph)

    # ------------------------------------------------------ eval and predict
    def eval(self, eval_dataloader: Any = None, subset_num_batches: int = -1) -> Dict[str, Any]:
        """Evaluate now (after ``fit``, or on a loaded model), firing the EVAL_* events.

        ``eval_dataloader``: a dataloader, `Evaluator`(s) or ``{label: loader}``; default the Trainer's
        evaluators. Returns ``{"metrics/<label>/<name>": value}`` (logged too while the loggers are open).
        """
        evaluators = ensure_evaluators(eval_dataloader) if eval_dataloader is not None else self.state.evaluators
        if not evaluators:
            raise ValueError("Nothing to evaluate: pass eval_dataloader here or to Trainer(eval_dataloader=...).")
        return run_evaluation(self, evaluators, subset_num_batches, log=not self.engine.closed)

    def predict(self, dataloader: Any, subset_num_batches: int = -1, return_outputs: bool = True) -> List[Any]:
        """``model(batch)`` for each batch with the PREDICT_* events; the outputs on the CPU (see `run_predict`)."""
        return run_predict(self, dataloader, subset_num_batches, return_outputs)

    def _evaluate_due(self, event: Event) -> None:
        """Run the evaluators whose interval fires at ``event``."""
        state = self.state
        due = [e for e, interval in zip(state.evaluators, self._eval_intervals) if interval(state, event)]
        if due:
            run_evaluation(self, due)

    # --------------------------------------------------------------- helpers
    def close(self) -> None:
        """Close callbacks and loggers (fit does this itself)."""
        self.engine.close()
