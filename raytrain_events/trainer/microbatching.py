"""Auto microbatching (``grad_accum="auto"``): on a device out-of-memory error, retry the batch in more pieces.

Composer's ``device_train_microbatch_size="auto"``, for the number of microbatches. The loop starts
with one microbatch per batch (or the value a checkpoint saved). When forward or backward raises
``torch.OutOfMemoryError`` on any rank, every rank drops what the attempt built (outputs, loss,
gradients), the number of microbatches doubles, and the same batch runs again. The result of the
batch (gradients, loss, sample and token counts) is what starting with that setting gives.

Ranks agree through the batch's own collective: in this mode the loop's per-batch counter sum
(`raytrain_events.trainer.counters`) runs *after* the batch's forward/backward, with two more
integers (this rank hit OOM; this rank cannot split further). A rank that hit OOM goes straight to
that sum, the others get there after their microbatches, so no rank runs ahead and none waits in a
collective the others never join. For that, forward and backward must run no collective of their
own: under DDP the loop calls the DDP wrapper's module directly (DDP's hooks stay idle) and, once
the ranks agreed that nobody ran out of memory, averages the gradients and broadcasts rank 0's
buffers itself, as DDP would have (one flat all-reduce after backward instead of DDP's buckets
overlapping with it: the price of being able to retry).

Under FSDP forward and backward must all-gather and reduce-scatter, so the ranks instead agree at
every one of those collectives: `raytrain_events.parallel.oom_agreement.OOMAgreement` runs a
one-integer all-reduce before each of them (and one after the attempt's last microbatch); a rank
that ran out of memory joins the next one with its flag set, its peers stop there
(`PeerOutOfMemory`), FSDP's per-iteration state is reset and every rank then takes the same path as
above. Cost, paid only with ``grad_accum="auto"``: small host-side all-reduces, per FSDP unit and
microbatch one in forward and up to two in backward, plus one at the end of each backward and one
per attempt at the batch.

The chosen value is ``state.grad_accum``: logged as ``trainer/grad_accum`` when it changes, saved in
checkpoints and reused on resume.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from raytrain_events.core.event import Event
from raytrain_events.dist import Dist
from raytrain_events.parallel.oom_agreement import OOMAgreement, PeerOutOfMemory
from raytrain_events.parallel.wrap import is_sharded_module
from raytrain_events.trainer.counters import BatchCounters, Counters
from raytrain_events.trainer.options import AUTO, parse_grad_accum  # re-exported: the option's check lives there

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = [
    "AUTO",
    "Accumulate",
    "parse_grad_accum",
    "AutoMicrobatching",
    "DeferredCounters",
    "auto_microbatching_of",
    "batch_counters",
]

_log = logging.getLogger(__name__)


class DeferredCounters:
    """The loop's per-batch counter sum, run after forward/backward with the OOM flags appended.

    Same interface as `BatchCounters` (`start` before the batch, `wait` after it); `agree` is the
    collective itself, called by `AutoMicrobatching` once per attempt at the batch.
    """

    def __init__(self, dist: Dist) -> None:
        self.dist = dist
        self.on_gradients = False
        self._values: Optional[List[int]] = None
        self._sums: Optional[List[int]] = None

    def start(self, values: Sequence[int]) -> None:
        """Remember this batch's values (summed later, by `agree`)."""
        self._values, self._sums = list(values), None

    def carry(self, loss: Any) -> Any:
        """The loss as it is: here the counters never ride on the gradients."""
        return loss

    def after_backward(self) -> None:
        """Nothing to take from the gradients."""

    def agree(self, extra: Sequence[int]) -> List[int]:
        """Sum this batch's values and ``extra`` over all ranks; returns the sums of ``extra``."""
        values = self._values
        assert values is not None, "DeferredCounters.agree() without start()"
        local = [*values, *extra]
        sums = self.dist.sum_ints_async(local).wait() if self.dist.is_distributed else local
        self._sums = sums[: len(values)]
        return sums[len(values) :]

    def wait(self) -> List[int]:
        """The sums of this batch's values over all ranks (from the last `agree`)."""
        sums, self._sums, self._values = self._sums, None, None
        assert sums is not None, "DeferredCounters.wait() before agree()"
        return sums


class Accumulate(Protocol):
    """The loop's forward/backward of ``state.batch`` in ``grad_accum`` microbatches (sets ``state.loss``)."""

    def __call__(
        self,
        grad_accum: int,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> None: ...


class AutoMicrobatching:
    """Runs a batch's microbatches, doubling their number after a device OOM on any rank.

    It sees what it needs of the loop, not the `Trainer`: the `State` (batch, ``grad_accum``,
    optimizers), the loop's ``accumulate`` and the `Logger` it reports a new ``grad_accum`` to.
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the loop's pieces it works with)
        self,
        *,
        state: State,
        accumulate: Accumulate,
        logger: Logger,
        counters: DeferredCounters,
        ddp: Any,
        agreement: Optional[OOMAgreement] = None,
    ) -> None:
        self.state = state
        self._accumulate = accumulate
        self.logger = logger
        self.counters = counters
        self.ddp = ddp  # the DDP wrapper whose reduction this replaces, or None
        self.agreement = agreement  # under FSDP: the OOM checks at each of its collectives, or None

    def accumulate(
        self,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> None:
        """Forward/backward of ``state.batch`` until every rank got through; then sync gradients."""
        state = self.state
        full_batch, samples = state.batch, state.batch_num_samples
        while True:
            pieces = min(state.grad_accum, samples)  # a short last batch may need fewer pieces
            oom = self._attempt(pieces, active, autocast, create_graph)
            if oom:
                self._free(full_batch)
            cannot_split = oom and pieces >= samples
            oom_ranks, stuck_ranks = self.counters.agree([int(oom), int(cannot_split)])
            if not oom_ranks:
                break
            if stuck_ranks:
                raise RuntimeError(
                    f"Out of device memory with microbatches of one sample (grad_accum={state.grad_accum}) on "
                    f"{stuck_ranks} rank(s): the model does not fit. Lower batch_size, use precision='amp_bf16', "
                    "or shard the model (parallelism='fsdp')."
                )
            if not oom:
                self._free(full_batch)  # another rank ran out: drop this rank's attempt too
            state.grad_accum *= 2
            _log.warning(
                "Out of device memory on %d rank(s) at step %d: retrying the batch with grad_accum=%d.",
                oom_ranks,
                state.step,
                state.grad_accum,
            )
            self.logger.log_metrics({"trainer/grad_accum": state.grad_accum}, step=state.step)
        if self.ddp is not None:
            self._sync(self.ddp)

    def _attempt(
        self,
        pieces: int,
        active: Mapping[Event, bool],
        autocast: Optional[contextlib.AbstractContextManager[Any]],
        create_graph: bool,
    ) -> bool:
        """One attempt at the batch in ``pieces`` microbatches; True if this rank ran out of memory.

        Under FSDP (``agreement``) a peer's error stops this rank at the next check, and after any
        error FSDP's per-iteration state is reset on every rank."""
        oom = peer = False
        agreement = self.agreement
        if agreement is not None:
            agreement.begin()
        try:
            self._accumulate(pieces, active, autocast, create_graph)
            if agreement is not None:
                agreement.finish()  # the attempt's last check: a peer may have failed after this rank's last
        except torch.OutOfMemoryError:
            oom = True  # leave the except block first: its traceback holds the attempt's tensors
        except PeerOutOfMemory:
            peer = True  # another rank failed (FSDP): this rank stopped at the check that said so
        if agreement is not None and (oom or peer):
            if oom:
                agreement.fail()  # the peers' next check learns of it
            agreement.reset()
        return oom

    def _free(self, full_batch: Any) -> None:
        """Drop what the failed attempt built: outputs, loss, gradients, cached device blocks."""
        state = self.state
        state.outputs = state.loss = None
        state.batch = full_batch
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @staticmethod
    def _sync(ddp: Any) -> None:
        """What DDP's reducer and forward would have done: average gradients, broadcast rank 0's buffers."""
        import torch.distributed as tdist

        group = ddp.process_group
        world = tdist.get_world_size(group)
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for param in params:  # one flat all-reduce per gradient dtype
            by_dtype.setdefault(param.dtype, []).append(param)
        for group_params in by_dtype.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group_params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            tdist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for param, grad in zip(group_params, grads):
                param.grad = flat[offset : offset + grad.numel()].view_as(grad)
                offset += grad.numel()
        if ddp.broadcast_buffers:
            buffers = list(ddp.module.buffers())
            if buffers:
                src = tdist.get_global_rank(group, 0) if group is not None else 0
                for buffer in buffers:
                    tdist.broadcast(buffer, src=src, group=group)


def batch_counters(*, state: State, dist: Dist, ddp: Any, train_model: Any, deferred: bool) -> Tuple[Counters, Any]:
    """How the loop sums each batch's counts across ranks, and the model the loop trains. Per-batch sums ride on
    DDP's gradient all-reduce when possible (`BatchCounters`, no collective of their own); under auto microbatching
    (``deferred``: retry after OOM) DDP runs no collective in forward/backward (the loop trains its inner module),
    so the sums are deferred (`DeferredCounters`)."""
    if not deferred:
        return BatchCounters(dist, ddp), train_model
    state.auto_microbatching = True
    return DeferredCounters(dist), ddp.module if ddp is not None else train_model


def auto_microbatching_of(  # noqa: PLR0913 (keyword-only: the loop's pieces it works with)
    *, state: State, logger: Logger, counters: Counters, ddp: Any, wrapped: Any, accumulate: Accumulate
) -> AutoMicrobatching:
    """Auto microbatching over the loop's ``accumulate`` (with `batch_counters`' deferred sums); ``wrapped``: the
    model as wrapped for training, whose ranks, under FSDP, agree on an OOM at each of its collectives
    (`OOMAgreement`)."""
    assert isinstance(counters, DeferredCounters), "auto microbatching defers the batch's sums (batch_counters)"
    return AutoMicrobatching(
        state=state,
        accumulate=accumulate,
        logger=logger,
        counters=counters,
        ddp=ddp,
        agreement=OOMAgreement(wrapped, counters.dist) if is_sharded_module(wrapped) else None,
    )
