"""`SpikeGuard`: on a loss spike, every rank rolls back to a host copy of a good state and skips
exactly the rows trained since, instead of the run dying (`NaNMonitor`) or training on.

Per batch, on each rank (no collective of its own):

1. ``after_train_batch`` (before the optimizer step): this rank's gradient norm (one ``vector_norm``
   per parameter tensor; none with a `GradientClipping` by the L2 norm: its pre-clip norm is reused).
   On CUDA the loss and norm start a non-blocking copy into a pinned host buffer here, so that
   ``batch_end`` waits for that copy only, not for the optimizer step queued after it. On the CPU,
   judging the loss alone or with a `GradientClipping` (its norm, shared or the guard's taken at
   ``AFTER_BACKWARD``, is read at ``batch_end``), the guard drops this hook at INIT (`overridden_events`).
2. ``batch_end``: the `SpikeDetector` (``core/spikes.py``) judges them against its trailing window;
   a spike is *requested* on the agreement flag ``spike`` (`raytrain_events.core.agreement`). The
   flag rides on the next batch's counter collective (the one the loop runs anyway), so one batch
   later every rank sees it *agreed*, at the same batch, and rolls back together.
3. Every ``snapshot_interval`` batches (and at the start of each fit) a host snapshot of the state
   (`HostSnapshots`, ``checkpoint/run/host_snapshot.py``). A rollback restores the newest snapshot
   from before the spiking batch (model, optimizers, schedulers, scaler, algorithms, callbacks, RNGs),
   on every rank, without a storage read; judging the loss alone, the newest whose weights a later batch's
   loss was judged good on (the snapshot and the rollback: ``spike_rollback.py``).

The Timestamp is *not* restored: the run goes on at its current position, so the rows of the
batches between the restored state and the agreement (``[snapshot, now)`` of each epoch's global
order: the spiking batch, the batches before it back to the snapshot, and the one batch the
agreement took) are skipped, never trained, and every loader continues where it is (the Ray
feeder's global order, a local DataLoader; a resume re-enters at the checkpoint's position, which is
past them, at any world size). The skipped ranges are a `SkipList` in the guard's state, saved in
every checkpoint; ``trained = timestamp - skipped`` (`SpikeGuard.trained`). Torch LR schedulers
restored from the snapshot are stepped once per skipped batch, so a schedule keeps following the
position, as in the run without the spike.

The fit's last batch has no next batch to carry the flag: there (its ``BATCH_END``, or ``EPOCH_END`` of an 'ep'
duration's last epoch, before the epoch's checkpoint) the ranks sum the flag once and roll back at once.
Under replica groups the flag rides on each step's gradient all-reduce instead (``spike_groups.py``).

A spike within ``snapshot_interval`` batches after a rollback rolls back to the same snapshot again:
the window widens (the rows trained since are skipped too), up to ``max_window`` batches; after
``max_rollbacks`` rollbacks the run stops with `SpikeRollbackError` naming every skipped range.

Example::

    Trainer(..., callbacks=[SpikeGuard(snapshot_interval=50, loss_ratio=2.0, grad_zscore=6.0)])
    RayTrainer(..., callbacks=[SpikeGuard()])   # an instance: a bad knob fails here, before Ray starts
    SpikeGuard(bisect=True, row_key="id")       # find the culprit rows, quarantine them, train the rest
    SpikeGuard(row_key="id", quarantine_from="quarantine.json")   # keep an earlier run's culprits out

The guard puts itself last among the callbacks at INIT (its snapshot and rollback see every other callback's
batch done) and calls every callback's ``on_rollback`` after a restore. The skip list names its data (the
seed and a `Mixture`'s sources): a resume on other data is refused. Cost per batch: one read of the loss (and
the gradient norm, unless shared with the clipping); per snapshot one host copy of the state, every
``snapshot_interval`` (default 50) batches: longer costs less, and a rollback reaches further back (docs/spikes.md).

Notes: the gradient norm is this rank's (under FSDP the norm of its shards); with a GradScaler
(``amp_fp16``) non-finite gradients are the scaler's to skip and are not judged. With `GradientClipping`
the norm judged is the one *before* clipping (a blow-up is judged, not capped first): the clipping's own
pre-clip norm when shared, else the guard's norm taken at ``AFTER_BACKWARD`` (before the algorithms run at
``AFTER_TRAIN_BATCH``; with ``grad_accum`` > 1 the last microbatch's, over the accumulated gradients).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from raytrain_events.algorithms.gradient_clipping import GradientClipping
from raytrain_events.callbacks.spike_bisect import (
    QuarantineFilter,
    QuarantineHooks,
    count_dropped,
    device_of,
    read_quarantine,
    start_quarantine,
    sum_over_ranks,
)
from raytrain_events.callbacks.spike_groups import GroupVoting, find_step_vote
from raytrain_events.callbacks.spike_norm import PreClipNorm, grad_norm
from raytrain_events.callbacks.spike_rollback import judged_good, roll_back, take_snapshot
from raytrain_events.checkpoint.run.host_snapshot import HostSnapshots
from raytrain_events.core.callback import Callback
from raytrain_events.core.event import Event
from raytrain_events.core.interval import is_done
from raytrain_events.core.logger import Logger
from raytrain_events.core.quarantine import Quarantine
from raytrain_events.core.spikes import (
    RollbackPolicy,
    SkipList,
    SpikeDetector,
    SpikeRollbackError,
    Verdict,
)
from raytrain_events.core.state import State, _keyed
from raytrain_events.core.timestamp import Timestamp
from raytrain_events.data.mixture_counts import MixtureCounts
from raytrain_events.trainer._batch import total_loss

stack = torch.stack

__all__ = ["SpikeGuard", "SpikeRollbackError"]

FLAG = "spike"
SNAPSHOT_INTERVAL = 50  # the default: the snapshot's cost against the window a rollback skips (docs/spikes.md)
_log = logging.getLogger(__name__)


def _check_options(  # noqa: PLR0913 (the options that must agree with each other)
    snapshot_interval: int,
    loss_ratio: Optional[float],
    bisect: bool,
    row_key: Optional[str],
    quarantine_from: Optional[str],
    row_ids: Optional[str],
) -> None:
    """Refuse, when the guard is built, a snapshot interval below one batch, and a bisect, quarantine or row-id
    option without what it needs (a loss ratio to judge groups by, a ``row_key`` to name rows by)."""
    if isinstance(snapshot_interval, bool) or not isinstance(snapshot_interval, int) or snapshot_interval < 1:
        raise ValueError(
            f"snapshot_interval={snapshot_interval!r} must be an integer >= 1 (batches between host snapshots): "
            "without a host copy a rollback has nothing to restore."
        )
    if bisect and loss_ratio is None:
        raise ValueError("bisect=True tests groups of rows by their loss: it needs loss_ratio (e.g. 2.0), not None.")
    if (bisect or quarantine_from is not None) and not (isinstance(row_key, str) and row_key):
        raise ValueError(
            "bisect=True and quarantine_from name rows by a batch column: pass row_key='id' (the column "
            "holding each row's integer id, e.g. its row number in the dataset)."
        )
    if row_ids not in (None, "mixture") or (row_ids is not None and not row_key):
        raise ValueError(
            f"row_ids={row_ids!r}: pass row_ids='mixture' with a row_key whose ids number a Mixture's rows source "
            "after source (the ledger then answers SOURCE:N for quarantined rows), or leave it None."
        )


class SpikeGuard(Callback):
    """Detect a loss spike, roll every rank back to a host snapshot, skip the window's rows (see module).

    Arguments: ``snapshot_interval`` (batches between host snapshots, >= 1), the `SpikeDetector`'s
    ``window``, ``loss_ratio``, ``grad_zscore``, ``warmup``, and the `RollbackPolicy`'s
    ``max_rollbacks``, ``max_window``; ``bisect`` (find the window's culprit rows and quarantine them
    instead of skipping the window, ``spike_bisect.py``), ``row_key`` (the batch column naming each row,
    needed by both quarantine options; ``row_ids="mixture"``: under a `Mixture` its ids number the mixture's rows
    source after source in ``Mixture.names`` order, source ``i``'s row ``r`` being ``rows of the sources before i + r``, so the ledger answers
    ``SOURCE:N`` for quarantined rows too), ``quarantine_from`` (a quarantine file of an earlier run, read
    here); all checked here, before any work starts. ``quarantine``: the rows kept out (checkpointed).
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the detector's and the policy's knobs)
        self,
        *,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
        window: int = 100,
        loss_ratio: Optional[float] = 2.0,
        grad_zscore: Optional[float] = 6.0,
        warmup: int = 10,
        max_rollbacks: int = 5,
        max_window: int = 1000,
        bisect: bool = False,
        row_key: Optional[str] = None,
        quarantine_from: Optional[str] = None,
        row_ids: Optional[str] = None,
    ) -> None:
        _check_options(snapshot_interval, loss_ratio, bisect, row_key, quarantine_from, row_ids)
        self.snapshot_interval = snapshot_interval
        self.detector = SpikeDetector(window=window, loss_ratio=loss_ratio, grad_zscore=grad_zscore, warmup=warmup)
        self.policy = RollbackPolicy(max_rollbacks=max_rollbacks, max_window=max_window)
        self.bisect, self.row_key, self.row_ids = bool(bisect), row_key, row_ids
        self.quarantine = Quarantine()  # the rows not trained any more (bisect's culprits, and quarantine_from's)
        self._from_file = read_quarantine(quarantine_from) if quarantine_from is not None else None
        self._filter = QuarantineFilter(row_key) if row_key else None
        self._qids: List[int] = []
        self._dropped_totals: List[int] = []  # the per-batch sums of this fit's dropped rows (tokens, sources), as read
        self._batches: Deque[Any] = deque()  # with bisect: this rank's batch per _history record (the window's rows)
        self._facts: Deque[Any] = deque()  # ... and what the filter counts them by (a mixture's rows' sources)
        self.skips = SkipList()
        self.rollbacks: List[Dict[str, Any]] = []  # one record per rollback (plain values; saved)
        self._snapshots: Optional[HostSnapshots] = None
        self._norm: Optional[torch.Tensor] = None  # this batch's gradient norm (this rank's)
        self._params: Optional[List[torch.Tensor]] = None
        self._pipelined = False  # whether the model is a pipeline's stage (found with the params)
        self._clip: Optional[GradientClipping] = None  # a GradientClipping whose norm is shared (see after_train_batch)
        self._clip_seen: Optional[torch.Tensor] = None  # its norm already judged (a stale one is not judged twice)
        self._clip_other = False  # a GradientClipping whose norm is not shared: the norm is taken before it runs
        self._pre_clip: Optional[torch.Tensor] = None  # that norm, taken at AFTER_BACKWARD
        self._host: Optional[torch.Tensor] = None  # pinned host buffer of (loss, norm) on an accelerator
        self._ready: Optional[torch.cuda.Event] = None  # its copy's event, recorded before the optimizer step
        self._event: Optional[torch.cuda.Event] = None
        self._spike: Optional[Tuple[int, Verdict]] = None  # this rank's latest spike (batch, verdict), until agreed
        # One record per batch since the oldest snapshot: (Timestamp after it, samples, tokens, what the quarantine
        # dropped from it on every rank: (rows, tokens, rows per source), or None); the window's rows.
        self._history: Deque[Tuple[Timestamp, int, int, Optional[Tuple[int, int, Dict[str, int]]]]] = deque()
        self._since = 0  # batches since the newest snapshot (or rollback)
        self._unjudged = 0  # the most good batches a snapshot still waits for (loss alone: judged_good)
        self._group: Optional[GroupVoting] = None  # under replica groups: the vote on each step (spike_groups.py)
        self._key = "SpikeGuard"
        self._loss_only = False  # the gradient norm not judged (decided at FIT_START; spike_rollback.rollback_target)
        self._before_step = True  # whether AFTER_TRAIN_BATCH has a job (decided at INIT)
        self._norm_at_end = False  # the gradient norm read at BATCH_END instead (decided at FIT_START)
        self._on_cpu = True  # training on the CPU: no host copy of the loss to start (decided at INIT)

    # ------------------------------------------------------------------ setup
    def init(self, state: State, logger: Logger) -> None:
        state.agreement.register(FLAG)
        if self._filter is not None:  # the dropped rows (their tokens, a mixture's sources) on the per-batch sum
            loader = next((c.loader for c in state.callbacks if isinstance(c, MixtureCounts)), None)
            for name in self._filter.bind(state.count_tokens, loader):
                state.agreement.register_count(name)
        # Last among the callbacks (the Trainer refreshes the Engine after INIT): a snapshot and a rollback at
        # BATCH_END then see every other callback's batch done (per-source counts, monitors), so a restore
        # leaves none of them counting a skipped batch.
        # Hooks on more events only where they have a job (an event no callback overrides costs nothing a batch):
        # the quarantine's filter, and the norm before an unshared GradientClipping clips.
        hooks: List[Callback] = [QuarantineHooks(self)] if self._filter is not None else []
        if any(isinstance(a, GradientClipping) for a in state.algorithms):
            hooks.append(PreClipNorm(self))
        vote = find_step_vote(state)  # replica groups: the step's commit vote carries the decision (spike_groups.py)
        self._group = GroupVoting(self, vote) if vote is not None else None
        hooks += [self._group] if self._group is not None else []
        # AFTER_TRAIN_BATCH only with a job there (the norm, a group's verdict, an accelerator's loss copy): else idle.
        # With a GradientClipping on the CPU the norm needs no hook there either: a shared clipping's pre-clip norm
        # is still its ``last_grad_norm`` at BATCH_END, an unshared one's was taken at AFTER_BACKWARD (`PreClipNorm`).
        on_cpu = self._on_cpu = device_of(state).type == "cpu"
        norm_before_step = self.detector.grad_zscore is not None and not any(
            isinstance(a, GradientClipping) for a in state.algorithms
        )
        self._before_step = self._group is not None or norm_before_step or not on_cpu
        state.callbacks.remove(self)
        state.callbacks.extend(hooks)
        state.callbacks.append(self)

    def overridden_events(self) -> List[Event]:
        """Less ``AFTER_TRAIN_BATCH`` where it has no job (decided at INIT; the Engine reads this right after)."""
        events = super().overridden_events()
        return events if self._before_step else [e for e in events if e is not Event.AFTER_TRAIN_BATCH]

    def fit_start(self, state: State, logger: Logger) -> None:
        self._key = next(k for k, c in _keyed_callbacks(state).items() if c is self)
        fingerprint: Dict[str, Any] = {"seed": state.seed}
        counts = next((c for c in state.callbacks if isinstance(c, MixtureCounts)), None)
        if counts is not None:  # the sources (names, rows); weights may change (a switched stage) and still fit
            fingerprint["sources"] = counts.loader.mixture.to_dict()["sources"]
        self.skips.check_fingerprint(fingerprint)
        self.skips.fingerprint.update(fingerprint)
        skipped = state.skipped
        if self.skips.ranges and not skipped.batches:  # a checkpoint from before State.skipped: from the skip list
            skipped.batches, skipped.samples, skipped.tokens = self.skips.totals()
        self._dropped_totals = [0] * len(self._filter.count_names) if self._filter is not None else []
        if self.row_key is not None:
            start_quarantine(self, state, {k: v for k, v in fingerprint.items() if k != "seed"})
        # Judging the loss alone (no gradient norm: grad_zscore=None, or a GradScaler's run), a snapshot is a
        # rollback target only once a batch trained from it was agreed good (`spike_rollback.rollback_target`):
        # with one snapshot a batch, 3 kept (the target and the two taken since), else 2.
        self._loss_only = state.scaler is not None or self.detector.grad_zscore is None
        self._norm_at_end = not self._before_step and not self._loss_only  # (a clipping's norm: read at BATCH_END)
        keep = 3 if self._loss_only and self.snapshot_interval == 1 else 2
        self._snapshots = HostSnapshots(state, exclude_callbacks={self._key}, keep=keep)
        self._history.clear()
        self._batches.clear()
        self._facts.clear()
        take_snapshot(self, state)
        if self._group is not None:
            self._group.start(state)

    # --------------------------------------------------------------- per batch
    def after_train_batch(self, state: State, logger: Logger) -> None:
        # Loss only (``_loss_only``, set at FIT_START: amp_fp16's scaler skips steps with inf gradients itself;
        # without a gradient test a non-finite gradient shows in the next batch's loss; the snapshot between is
        # passed over: spike_rollback): no norm.
        norm = self._norm = None if self._loss_only else grad_norm(self, state)
        group = self._group
        if group is None and self._on_cpu:  # the CPU: batch_end reads the loss itself (no copy to start)
            return
        loss = state.loss
        if loss is not None and type(loss) is not torch.Tensor:
            loss = total_loss(loss).detach()
        if group is not None:  # replica groups: judged now, the verdict rides on the step's all-reduce
            group.judge(state, loss, norm)
        elif loss is not None and loss.is_cuda:
            self._to_host(loss, norm)

    def _to_host(self, loss: torch.Tensor, norm: Optional[torch.Tensor]) -> None:
        """Start the copy of the loss (and norm) into a pinned host buffer, before the optimizer step is queued:
        ``batch_end`` then waits for that copy only, not for the step (one ``.item()`` would wait for all)."""
        values = (
            loss.reshape(1).float() if norm is None else stack([loss.reshape(()).float(), norm.to(loss.device).float()])
        )
        host = self._host
        if host is None or host.numel() != values.numel():
            host = self._host = torch.empty(values.numel(), pin_memory=True)  # pinned: the copy is asynchronous
        host.copy_(values, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()  # one, recorded again each batch
        self._event.record()
        self._ready = self._event

    def _from_host(self, ready: torch.cuda.Event, with_norm: bool) -> Tuple[float, Optional[float]]:
        """The loss (and norm) `_to_host` copied, once its copy has landed."""
        assert self._host is not None
        ready.synchronize()
        read = self._host.tolist()
        return read[0], (read[1] if with_norm else None)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._group is not None:
            self._group.step_end(state, logger)
            return
        if self._norm_at_end:  # where after_train_batch would have read it (its hook not taken: `init`)
            self._norm = grad_norm(self, state)
        ts = state.timestamp  # immutable: kept as it is, read only at a rollback (no per-batch conversions)
        dropped = count_dropped(self, state, logger) if self._filter is not None else None
        self._history.append((ts, state.global_batch_num_samples, state.global_batch_num_tokens, dropped))
        if self.bisect:
            self._batches.append(state.batch)
            self._facts.append(self._filter.facts() if self._filter is not None else None)
        if state.agreement.agreed(FLAG):
            state.agreement.clear(FLAG)
            roll_back(self, state, logger, int(ts.batch) - 1)  # requested at the batch before, agreed on this one
            return
        if self._unjudged:  # no rank saw a spike at the batch before: it vouches for the snapshot it started from
            judged_good(self)  # (only judging the loss alone, the 2 batches after a snapshot: `owed`; else none waits)
        norm, ready, self._norm, self._ready = self._norm, self._ready, None, None
        grad: Optional[float] = None
        if ready is not None:  # on an accelerator: the copy after_train_batch started
            value, grad = self._from_host(ready, norm is not None)
        else:
            loss = state.loss
            if type(loss) is not torch.Tensor:
                loss = total_loss(loss).detach()
            if norm is None:
                value = loss.item()
            else:
                value, grad = _read_both(loss, norm)
        verdict = self.detector.observe(value, grad)
        if verdict is not None:
            self._spike = (ts.get_value("ba"), verdict)
            state.request(FLAG)
        self._since += 1
        if (state.stop_requested and state.stop_consistent) or is_done(state):
            self._agree_last_batch(state, logger)  # the fit's last batch: no next batch to carry the flag
        elif self._since >= self.snapshot_interval:
            take_snapshot(self, state)

    def epoch_end(self, state: State, logger: Logger) -> None:
        # The epoch's last batch was the fit's (an 'ep' duration ends here): agree on its spike now, before the
        # epoch's checkpoint is saved (EPOCH_CHECKPOINT comes after EPOCH_END).
        if is_done(state) and self._group is None:  # (replica groups: agreed in the batch's own step)
            self._agree_last_batch(state, logger)

    def _agree_last_batch(self, state: State, logger: Logger) -> None:
        """Every rank, at the fit's last batch (the same on every rank: the Timestamp and an agreed stop decide):
        one sum across ranks of the spike flag (the only collective of the guard's own, once a fit), and the
        rollback if any rank saw a spike, before the batch's or the epoch's checkpoint is saved."""
        asked = 1.0 if state.agreement.requested(FLAG) else 0.0
        if sum_over_ranks([asked], device_of(state))[0] > 0:
            state.agreement.clear(FLAG)
            roll_back(self, state, logger, int(state.timestamp.batch))

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._spike is not None and state.agreement.requested(FLAG):
            # The agreement rides on the next batch's sum, and there is none: say so rather than end quietly.
            batch, verdict = self._spike
            _log.warning(
                "Loss spike at batch %d (%s) on rank %d, the fit's last batch: the fit ended before every rank could "
                "agree on a rollback, so its step stays in the final state (not rolled back, not skipped).",
                batch,
                verdict.reason,
                state.rank,
            )
            state.agreement.clear(FLAG)  # the next fit's snapshots start after it: nothing to roll back to
        self._spike = None

    # ------------------------------------------------------------ accounting
    def trained(self, state: State) -> Dict[str, int]:
        """Batches, samples and tokens actually trained: the Timestamp's totals less ``state.skipped``'s."""
        ts = state.timestamp
        return state.skipped.trained(int(ts.batch), int(ts.sample), int(ts.token))

    def state_dict(self) -> Dict[str, Any]:
        return {
            "quarantine": self.quarantine.state_dict(),
            "skips": self.skips.state_dict(),
            "rollbacks": list(self.rollbacks),
            "detector": self.detector.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skips = SkipList.from_state_dict(state.get("skips", {}))
        self.quarantine = Quarantine.from_state_dict(state.get("quarantine", {}))  # none in checkpoints before it
        self.rollbacks = list(state.get("rollbacks", []))
        self.detector.load_state_dict(state.get("detector", {}))


def _read_both(loss: torch.Tensor, norm: torch.Tensor) -> Tuple[float, float]:
    """The loss and the gradient norm as floats: two reads on the CPU, else one host sync for both."""
    if loss.is_cpu:
        return loss.item(), norm.item()
    value, grad = stack([loss.reshape(()).float(), norm.to(loss.device).float()]).tolist()
    return value, grad


def _keyed_callbacks(state: State) -> Dict[str, Any]:
    return _keyed(state.callbacks)
