"""`SpikeGuard`'s host snapshots and rollback: which snapshot a spike restores, the restore on every rank, and
the skipped window's accounting (the skip list, ``state.skipped``, the schedulers, the log and the metrics).

Functions of the guard (``spike_guard.py``), called at the same batch on every rank (and, under replica groups,
at the same committed step in every group: ``spike_groups.py``):

* `take_snapshot`: a host snapshot of the state now (`HostSnapshots`), and the window's records before the
  oldest snapshot dropped;
* `judged_good`: the batch before (a group's: this step) was agreed good on every rank: each snapshot still
  unjudged counts one good batch more;
* `rollback_target`: the snapshot a spike at a batch restores. With the gradient norm judged, the newest from
  before the spiking batch (a batch whose gradient blew up is caught before its snapshot is taken). Judging the
  loss alone (``grad_zscore=None``, or a GradScaler's run), a batch's gradient can blow the weights up while its
  loss is finite: the snapshot taken after it holds the damage and the spike shows only in the next batch's loss.
  So in that mode a snapshot is a target only once a batch trained from it was agreed good (one batch after the
  next, as the agreement is one batch late; a group's: the next committed step); until then the one before it
  is kept and restored. The cost: a spike in the batch right after a snapshot rolls back one interval further
  (its window ``snapshot_interval`` batches wider), and with ``snapshot_interval=1`` 3 host copies are kept
  instead of 2. None judged good yet (a spike in a fit's first batch): the snapshot the fit started from;
* `roll_back`: restore the target on every rank, skip the rows since (or, with ``bisect``, find and quarantine
  the culprits and train the rest: ``spike_bisect.py``), one record in ``guard.rollbacks``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from raytrain_events.callbacks.spike_bisect import bisect_window
from raytrain_events.checkpoint.run.host_snapshot import Snapshot
from raytrain_events.core.logger import Logger
from raytrain_events.core.spikes import SkipRange, SpikeRollbackError, window_ranges, window_record
from raytrain_events.core.state import State
from raytrain_events.data.mixture_counts import MixtureCounts

__all__ = ["judged_good", "roll_back", "rollback_target", "take_snapshot"]

_log = logging.getLogger("raytrain_events.callbacks.spike_guard")  # the guard's log, as before the split


def owed(guard: Any) -> int:
    """The agreed-good batches a new snapshot waits for before it is a rollback target (see the module doc)."""
    if not guard._loss_only:
        return 0
    return 1 if guard._group is not None else 2


def take_snapshot(guard: Any, state: State) -> None:
    """A host snapshot of the state now; the window's records from before the oldest snapshot dropped."""
    assert guard._snapshots is not None
    batch = int(state.timestamp.batch)
    unjudged = owed(guard)
    guard._snapshots.take({"batch": batch, "detector": guard.detector.state_dict(), "unjudged": unjudged})
    guard._since, guard._unjudged = 0, unjudged  # (the older snapshots owe no more than the new one: `judged_good`)
    oldest = guard._snapshots.snapshots[0].meta["batch"]
    history = guard._history
    if history:  # one record per batch, consecutive (a fit's Timestamp only goes forward): count, not compare
        for _ in range(min(len(history), oldest - history[0][0].get_value("ba") + 1)):
            history.popleft()
            if guard._batches:
                guard._batches.popleft()
                guard._facts.popleft()


def judged_good(guard: Any) -> None:
    """Every rank (every group) at once: the batch before (a group's: this step) was agreed good; each snapshot
    still unjudged counts one agreed-good batch more (the first trained from it makes it a rollback target).
    ``guard._unjudged``: the most any snapshot still owes (set to `owed` wherever a snapshot's count is), so nearly
    every batch, none owing, returns here without a walk (and the caller may test it first)."""
    assert guard._snapshots is not None
    if not guard._unjudged:
        return
    guard._unjudged -= 1
    for snapshot in guard._snapshots.snapshots:
        if snapshot.meta["unjudged"]:
            snapshot.meta["unjudged"] -= 1


def rollback_target(guard: Any, spike_batch: int) -> Optional[Snapshot]:
    """The snapshot a spike at ``spike_batch`` restores (see the module doc): the same on every rank and group."""
    assert guard._snapshots is not None
    newest = guard._snapshots.newest
    judged = newest(lambda meta: meta["batch"] < spike_batch and not meta["unjudged"])
    return judged if judged is not None else newest(lambda meta: meta["batch"] < spike_batch)


def roll_back(
    guard: Any, state: State, logger: Logger, spike_batch: int, elsewhere: str = "seen on another rank"
) -> None:
    """Every rank, at the same batch: restore the spike's `rollback_target`, skip the rows since."""
    assert guard._snapshots is not None
    now = int(state.timestamp.batch)
    local = guard._spike[1].reason if guard._spike is not None and guard._spike[0] == spike_batch else None
    reason = local or elsewhere
    snapshot = rollback_target(guard, spike_batch)
    if snapshot is None:  # unreachable with a snapshot at fit start; said plainly if it ever is
        raise SpikeRollbackError(f"A loss spike at batch {spike_batch} ({reason}) and no host snapshot before it.")
    restored = int(snapshot.meta["batch"])
    window = [window_record(*h[:3]) for h in guard._history if h[0].get_value("ba") > restored]
    guard.policy.check(len(guard.rollbacks), now - restored, guard.skips, f"batch {spike_batch}: {reason}")
    guard._snapshots.restore(lambda meta: meta["batch"] == restored)
    if snapshot.meta["unjudged"]:  # (the fit's first, not judged yet): owed again from the batch after now
        snapshot.meta["unjudged"] = guard._unjudged = owed(guard)
    guard.detector.load_state_dict(snapshot.meta["detector"])
    for callback in state.callbacks:
        callback.on_rollback(state, logger)
    search = bisect_window(guard, state, restored, now, window) if guard.bisect else {}
    retrained = bool(search.get("retrained"))
    fresh = [] if retrained else [h for h in window if not guard.skips.contains(h[1], h[2])]
    _skip(guard, state, fresh)
    if not retrained:  # the schedule follows the position: one step per batch since the snapshot
        for scheduler in state.schedulers:
            for _ in range(now - restored):
                scheduler.step()
    guard._spike, guard._norm, guard._since, guard._pre_clip, guard._ready = None, None, 0, None, None
    record = {
        "batch": now,
        "spike_batch": spike_batch,
        "reason": reason,
        "restored_batch": restored,
        "from": "host",
        "skipped": [[e, s, t] for e, s, t, _, _ in window_ranges(fresh)],
        **search,
    }
    guard.rollbacks.append(record)
    if retrained:  # the window is trained (without its culprits): the next window starts after it
        take_snapshot(guard, state)
    _report(guard, state, logger, record)


def _skip(guard: Any, state: State, fresh: list) -> None:
    """The window's batches not skipped before: into the skip list and ``state.skipped`` (per source too)."""
    plan = next((c.loader.plan for c in state.callbacks if isinstance(c, MixtureCounts)), None)
    for epoch, start, end, batches, tokens in window_ranges(fresh):
        guard.skips.add(SkipRange(epoch, start, end, batches, tokens))
        by_source = None
        if plan is not None:  # each source's samples in the window: its cursor moves over [start, end)
            names, at, to = plan.names, plan.cursors(epoch, start), plan.cursors(epoch, end)
            by_source = {n: b - a for n, a, b in zip(names, at, to) if b > a}
        state.skipped.add_window(batches, end - start, tokens, by_source)
    skipped_batches = {record[0] for record in fresh}  # rows dropped from them count as skipped now, not twice
    for h in guard._history:
        if h[3] is not None and h[0].get_value("ba") in skipped_batches:
            rows, tokens, by_source = h[3]
            state.skipped.add_quarantined(-rows, -tokens, {n: -k for n, k in by_source.items()})


def _report(guard: Any, state: State, logger: Logger, record: Dict[str, Any]) -> None:
    """The rollback in the log (rank 0) and in the metrics (the run report marks them on the loss plot)."""
    skipped_batches, skipped_samples, skipped_tokens = guard.skips.totals()
    if state.rank == 0:
        _log.warning(
            "Loss spike at batch %d (%s): every rank rolled back to the host snapshot of batch %d and skips %s "
            "(%d rollbacks; skipped in all: %s)%s.",
            record["spike_batch"],
            record["reason"],
            record["restored_batch"],
            ", ".join(f"epoch {e} rows [{s}, {t})" for e, s, t in record["skipped"]) or "nothing new",
            len(guard.rollbacks),
            guard.skips.describe(),
            f"; bisection found rows {record['quarantined']} ({guard.row_key}), quarantined; the rest of the window "
            "trained again"
            if record.get("retrained")
            else "",
        )
    logger.log_metrics(  # report/plots.py
        {
            "spikes/rollbacks": len(guard.rollbacks),
            "spikes/last_sample": int(state.timestamp.sample),
            "spikes/skipped_batches": skipped_batches,
            "spikes/skipped_samples": skipped_samples,
            "spikes/skipped_tokens": skipped_tokens,
            "spikes/quarantined_rows": state.skipped.quarantined,
        }
    )
