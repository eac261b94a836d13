"""The loop's batch under pipeline parallelism: the schedule runs forward, loss and backward, and the
loop's events fire where the work happens.

Which events fire where (per batch, ``m`` microbatches):

* every rank: ``BEFORE_DATALOADER``, ``AFTER_DATALOADER``, ``BATCH_START``, ``BEFORE_TRAIN_BATCH``,
  then once, after the schedule, ``AFTER_BACKWARD`` (this rank's stages hold every microbatch's
  gradient), ``AFTER_TRAIN_BATCH``, ``BATCH_END``, ``BATCH_CHECKPOINT``: ``state.batch`` is the whole batch;
* the first stage, per microbatch: ``BEFORE_FORWARD`` (``state.batch`` the microbatch: what an
  algorithm leaves there is what the first stage embeds);
* the last stage, per microbatch: ``AFTER_FORWARD`` (``state.outputs``: the model's outputs),
  ``BEFORE_LOSS``, ``AFTER_LOSS``, ``BEFORE_BACKWARD``: the loss exists there only. Algorithms that
  change the targets or the loss (label smoothing) run there.

``state.loss`` after the batch is the model's loss on every rank: the last stage sums its
microbatches' losses (each weighted by its share of the batch's samples, as grad accumulation
weights them, so the gradient is the batch mean), and the other stages get it from the loop's one
per-batch sum (`PipelineCounters`), as the float's 64 bits in one integer slot per pipeline. So
the sum cannot start before the batch as it does elsewhere (the loss does not exist yet): it runs
after the schedule, one small all-reduce of ``3 + flags + pipelines`` integers (``pipelines * c``
under context parallelism, below), and the last stage
reads its loss to the host (one device sync per step there).

The global `Timestamp` counts each sample and token once: only the first stage's rank 0 of each
context and tensor group counts (`Parallel.counts_data`).

Under context parallelism every rank of a pipeline cuts each microbatch to its part of the sequence
(`Pipeline.split`) after the rows are split (so ``BEFORE_FORWARD`` on the first stage and the loss
events on the last see this rank's part, as without PP); the last stage's ``c`` context ranks each
write their part's loss in a slot of their own of the same per-batch sum (``pipelines * c`` slots), and
every rank takes the model's loss as their mean (`ContextParallel.whole_loss`'s value, without its
all-reduce per microbatch).
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from raytrain_events.core.event import Event
from raytrain_events.dist import Dist
from raytrain_events.parallel.pipeline import Pipeline
from raytrain_events.parallel.tensor_parallel import _checksum
from raytrain_events.trainer._batch import total_loss

__all__ = ["PipelineCounters", "PipelineStep"]


class PipelineCounters:
    """The loop's per-batch sums across ranks (the `Counters` protocol) under pipeline parallelism,
    with each pipeline's loss riding on them: summed after the batch, never on the gradients."""

    on_gradients = False

    def __init__(self, dist: Dist, state: Any, coordinates: Tuple[int, int], pipeline: Pipeline) -> None:
        """``coordinates``: this rank's data-parallel ``(rank, size)`` (`Parallel.data_parallel`): which
        pipeline it is in, of how many."""
        self.dist, self.state = dist, state
        self.slot, self.pipelines = coordinates
        # Per pipeline the last stage's first rank of each tensor group writes its loss: one, or under
        # context parallelism one per context rank (its part's), in slot `slot * parts + part`.
        context = pipeline.context
        self.parts, self.part = (1, 0) if context is None else (context.degree, context.index)
        self.writes = pipeline.has_last and dist.rank % pipeline.config.tensor_parallel == 0
        self._values: List[int] = []

    def start(self, values: Sequence[int]) -> None:
        self._values = list(values)

    def carry(self, loss: Any) -> Any:
        return loss

    def after_backward(self) -> None:
        return None

    def wait(self) -> List[int]:
        values, self._values = self._values, []
        parts = self.parts
        losses = [0] * (self.pipelines * parts)
        loss = self.state.loss
        if self.writes and loss is not None:
            losses[self.slot * parts + self.part] = struct.unpack("<q", struct.pack("<d", float(loss)))[0]
        sums = self.dist.sum_ints_async(values + losses).wait()
        if not self.writes or parts > 1:  # the model's loss: the mean of the context parts' (each over a c-th)
            at = len(values) + self.slot * parts
            whole = sum(struct.unpack("<d", struct.pack("<q", bits))[0] for bits in sums[at : at + parts]) / parts
            self.state.loss = torch.tensor(whole, dtype=torch.float32)
        return sums[: len(values)]


class PipelineStep:
    """Forward, loss and backward of ``state.batch`` through the pipeline's schedule, with the events
    where they happen (see the module docstring); the `Trainer` calls `accumulate` per batch (and
    from an optimizer's closure) instead of its per-microbatch path."""

    def __init__(self, *, state: Any, engine: Any, pipeline: Pipeline, spec: Any, counters: PipelineCounters) -> None:
        """``counters``: the loop's per-batch sum, which carries the loss to the other stages."""
        self.state, self.engine, self.pipeline, self.spec = state, engine, pipeline, spec
        self.counters = counters
        self._active: Mapping[Event, bool] = {}
        self._fed: Dict[int, Any] = {}  # the first stage's microbatches of this batch, after BEFORE_FORWARD
        self._weights: List[float] = []  # each microbatch's share of the batch's samples (its loss weight)
        # The first step's first loss call is the stage's metadata inference (torch runs a forward and
        # the loss once to learn the shapes it sends): no events, the state untouched.
        self._loss_calls: Optional[int] = None  # counted in the first step only, then None
        self._inferring = pipeline.has_last
        self._checked = False  # the first batch's agreement across each pipeline's ranks (`_check_batches_agree`)
        pipeline.feed.before_forward = self._before_forward
        pipeline.feed.loss = self._loss

    def accumulate(
        self,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> None:
        """One batch through the schedule; sets ``state.loss`` on the last stage (the others get it in
        `PipelineCounters.wait`)."""
        state, pipeline, spec = self.state, self.pipeline, self.spec
        batch = state.batch
        microbatches = pipeline.microbatches
        total = spec.get_num_samples_in_batch(batch)
        pipeline.check_batch(batch)
        if total < microbatches:
            raise ValueError(
                f"The batch has {total} samples on rank {state.rank}, fewer than FSDPConfig(pipeline_microbatches="
                f"{microbatches}). Fix: a batch of at least {microbatches} rows per pipeline, or fewer microbatches."
            )
        if not self._checked:
            self._check_batches_agree(batch)
        self._active = active
        loaded = spec.split_batch(batch, microbatches)
        self._weights = [spec.get_num_samples_in_batch(microbatch) / total for microbatch in loaded]
        pipeline.feed.microbatches = [pipeline.split(microbatch) for microbatch in loaded]  # CP: this rank's part
        pipeline.feed.context = autocast
        state.loss = None
        first_step, self._loss_calls = self._inferring, 0
        try:
            losses = pipeline.step()
        finally:
            pipeline.feed.microbatches, self._fed = [], {}
        if first_step and self._loss_calls != microbatches + 1:
            raise RuntimeError(
                f"The pipeline's first step called the loss {self._loss_calls} times for {microbatches} microbatches; "
                "this torch's schedule does not infer the stage's shapes as PipelineStep expects (one extra call)."
            )
        self._loss_calls = None
        state.batch = batch
        if losses:
            total_loss = losses[0].detach()
            for loss in losses[1:]:
                total_loss = total_loss + loss.detach()
            state.loss = total_loss
        if active[Event.AFTER_BACKWARD]:
            self.engine.run_event(Event.AFTER_BACKWARD)

    def _check_batches_agree(self, batch: Any) -> None:
        """Once, before the first schedule: every rank of a pipeline must hold the same batch (the first
        stage embeds it, the last takes its targets: different batches would train wrongly, silently).
        One all-gather of 3 numbers per rank over every rank, so that no pipeline goes on alone."""

        self._checked = True
        counters = self.counters
        gathered = counters.dist.all_gather_object((counters.slot, _checksum(batch).tolist()))
        first: Dict[int, Any] = {}
        bad = {slot for slot, sums in gathered if first.setdefault(slot, sums) != sums}
        if bad:
            ranks = [[r for r, (slot, _) in enumerate(gathered) if slot == b] for b in sorted(bad)]
            config = self.pipeline.config
            apart = " (pipeline_outermost: a pipeline's stages are world_size / pipeline_parallel ranks apart)"
            raise ValueError(
                f"pipeline_parallel={config.pipeline_parallel}: the ranks of pipelines {ranks} got different batches; "
                "a pipeline's stages must load the same ones (the first stage embeds the batch, the last computes "
                "the loss on its targets). Fix: shard the data by the data-parallel rank, (rank, size) = "
                "trainer.parallel.data_parallel(rank, world_size), e.g. DistributedSampler(num_replicas=size, "
                f"rank=rank){apart if config.pipeline_outermost else ''}."
            )

    def _before_forward(self, index: int) -> Any:
        """The first stage's microbatch ``index`` after ``BEFORE_FORWARD``: fired once per microbatch,
        though the first step runs the first microbatch's forward twice (the stage learns the shapes
        it sends from a forward of its own), so both see the same microbatch."""
        fed = self._fed.get(index)
        if fed is not None:
            return fed
        state = self.state
        state.batch = self.pipeline.feed.microbatches[index]
        if self._active[Event.BEFORE_FORWARD]:
            self.engine.run_event(Event.BEFORE_FORWARD)
        self._fed[index] = state.batch
        return state.batch

    def _loss(self, outputs: torch.Tensor, index: int) -> torch.Tensor:
        """The last stage's loss of microbatch ``index``, weighted by its share of the batch's samples."""
        state, engine, active = self.state, self.engine, self._active
        microbatch, weight = self.pipeline.feed.microbatches[index], self._weights[index]
        if self._loss_calls is not None:
            self._loss_calls += 1
        if self._inferring:  # the metadata inference's forward ran on placeholder activations
            self._inferring = False
            with self.pipeline.feed.autocast():
                return total_loss(state.model.loss(outputs, microbatch)) * weight
        state.batch, state.outputs = microbatch, outputs
        for event in (Event.AFTER_FORWARD, Event.BEFORE_LOSS):
            if active[event]:
                engine.run_event(event)
        with self.pipeline.feed.autocast():
            state.loss = state.model.loss(state.outputs, state.batch)
        for event in (Event.AFTER_LOSS, Event.BEFORE_BACKWARD):
            if active[event]:
                engine.run_event(event)
        return total_loss(state.loss) * weight
