"""`Ledger`: was row ``N`` of source ``S`` trained before a checkpoint, and how many times?

No per-row log: the answer is computed from what already fixes the run's order: the `MixturePlan`
(mixture, seed; ``core/mixture_plan.py``), the checkpoint's `Timestamp` (epoch and position) and the
`SkipList` of the `SpikeGuard` (``core/spikes.py``). In epoch ``e`` source ``i`` gives its ``t``-th row
as row ``permute(t mod rows, rows, pass_key(seed, e, i, t // rows))`` (`MixturePlan.row`); the ledger
asks the plan for the inverse (`MixturePlan.read_of`: the keyed Feistel permutation run backwards) to find at which read ``t`` each pass of epoch ``e`` gives
row ``N``, then asks whether that read is before the checkpoint's cursor (`MixturePlan.cursors`) and
outside every skipped window (a window ``[a, b)`` of positions is the reads
``[cursors(e, a)[i], cursors(e, b)[i])`` of source ``i``).

Cost: per epoch one cursor walk (O(sources x log(epoch))) and one inverse permutation per pass over
the source, whatever the run's size (1e9 rows: ``bench/ledger.py``); state: the mixture, the seed,
the timestamp and the skip list (bytes, not rows).

A run without a mixture trains a plain dataset in its own order (no shuffle): position = row, one
source (`Ledger.plain`). Its `Quarantine` (``SpikeGuard(bisect=True, row_key=...)``, ids = the dataset's row
numbers) is answered too: a quarantined row is not trained from its quarantine's (epoch, position) on. A
mixture's quarantine is answered when its ids number the mixture's rows source after source
(``SpikeGuard(row_ids="mixture")``: source ``i`` of ``Mixture.names``, its row ``r`` is id ``sum(rows of sources before i) + r``;
the quarantine's fingerprint says so): a read of the row at a position at or after its quarantine's is
held. Other ids are the user's own column, not (source, row): not answered. A shuffled plain dataset's
order depends on its block sizes at run time and is not answered here (a `ValueError` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.core.mixture import Mixture
from raytrain_events.core.mixture_plan import MixturePlan
from raytrain_events.core.quarantine import Quarantine
from raytrain_events.core.spikes import SkipList

__all__ = ["Ledger", "LedgerAnswer", "ledger_of_checkpoint", "saved_plan"]


@dataclass(frozen=True)
class LedgerAnswer:
    """``times``: how often the row was trained before the checkpoint; ``epochs``: in which epochs (one entry
    per training); ``skipped``: the epochs whose skipped windows held it; ``quarantined``: the epochs the
    quarantine kept it out of."""

    source: str
    row: int
    times: int
    epochs: Tuple[int, ...]
    skipped: Tuple[int, ...]
    quarantined: Tuple[int, ...] = ()

    @property
    def trained(self) -> bool:
        return self.times > 0

    def line(self) -> str:
        where = f" (epochs {', '.join(map(str, self.epochs))})" if self.epochs else ""
        skipped = f"; skipped by a rollback in epochs {', '.join(map(str, self.skipped))}" if self.skipped else ""
        held = f"; quarantined in epochs {', '.join(map(str, self.quarantined))}" if self.quarantined else ""
        return f"{self.source}:{self.row} trained {self.times} times before the checkpoint{where}{skipped}{held}"


class Ledger:
    """Answers for one checkpoint: its position (``epoch``, ``sample_in_epoch``), the run's order and skips.

    Example::

        ledger = Ledger(plan=mixture.plan(seed=0), epoch=2, position=512, skips=guard.skips)
        ledger.ask("web", 123).times        # 0, 1, 2 or 3

    ``plan`` None: a plain unshuffled dataset named ``source`` (`Ledger.plain`), of ``rows`` rows (None:
    not known, rows not checked).
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the order, the checkpoint's position, the skips, a plain set)
        self,
        *,
        plan: Optional[MixturePlan],
        epoch: int,
        position: int,
        skips: Optional[SkipList] = None,
        rows: Optional[int] = None,
        source: str = "train",
        quarantine: Optional[Quarantine] = None,
    ) -> None:
        self.plan, self.epoch, self.position = plan, int(epoch), int(position)
        self.skips = skips if skips is not None else SkipList()
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.rows, self.source = rows, source
        self._mixture_ids = self.quarantine.fingerprint.get("row_ids") == "mixture"

    @classmethod
    def plain(  # noqa: PLR0913 (keyword-only: the checkpoint's position, its skips and quarantine)
        cls,
        rows: Optional[int],
        *,
        epoch: int,
        position: int,
        skips: Optional[SkipList] = None,
        shuffled: bool = False,
        quarantine: Optional[Quarantine] = None,
    ) -> Ledger:
        """The ledger of a run over one dataset in its own order (position = row)."""
        if shuffled:
            raise ValueError(
                "A shuffled plain dataset's order depends on its block sizes at run time; the ledger answers for "
                "a Mixture (its order is a function of the seed) or an unshuffled dataset."
            )
        return cls(plan=None, epoch=epoch, position=position, skips=skips, rows=rows, quarantine=quarantine)

    def _epochs(self, size: int) -> List[Tuple[int, int]]:
        """``(epoch, positions trained in it before the checkpoint)`` for every epoch up to the checkpoint's."""
        return [(e, size) for e in range(self.epoch)] + ([(self.epoch, self.position)] if self.position else [])

    def ask(self, source: str, row: int) -> LedgerAnswer:
        """How many times ``source:row`` was trained before the checkpoint (every epoch, minus skipped windows)."""
        if self.plan is None:
            return self._ask_plain(source, row)
        plan = self.plan
        if source not in plan.names:
            raise ValueError(f"No source {source!r} in the run's mixture (sources: {', '.join(plan.names)}).")
        i = plan.names.index(source)
        rows = plan.source_rows[i]

        def held_from(epoch: int) -> int:  # the source's first read at or after the quarantine's position
            assert since is not None
            return plan.cursors(epoch, since[1])[i]

        if not 0 <= row < rows:
            raise ValueError(f"Row {row} is outside source {source!r}'s {rows} rows.")
        epochs: List[int] = []
        skipped: List[int] = []
        held: List[int] = []
        since = self.quarantine.rows.get(sum(plan.source_rows[:i]) + row) if self._mixture_ids else None
        for epoch, end in self._epochs(plan.epoch_size):
            taken = plan.cursors(epoch, end)[i]
            windows = [
                (plan.cursors(epoch, r.start)[i], plan.cursors(epoch, min(r.end, end))[i])
                for r in self.skips.ranges
                if r.epoch == epoch and r.start < end
            ]
            for pass_ in range(-(-taken // rows)):
                t = plan.read_of(epoch, i, row, pass_)
                if t >= taken:
                    continue
                if any(lo <= t < hi for lo, hi in windows):
                    skipped.append(epoch)
                elif since is not None and (epoch > since[0] or (epoch == since[0] and t >= held_from(epoch))):
                    held.append(epoch)
                else:
                    epochs.append(epoch)
        return LedgerAnswer(source, row, len(epochs), tuple(epochs), tuple(skipped), tuple(held))

    def _ask_plain(self, source: str, row: int) -> LedgerAnswer:
        if source != self.source:
            raise ValueError(f"No source {source!r} in this run (its one dataset is {self.source!r}).")
        if row < 0 or (self.rows is not None and row >= self.rows):
            raise ValueError(f"Row {row} is outside the dataset's {self.rows} rows.")
        epochs: List[int] = []
        skipped: List[int] = []
        held: List[int] = []
        since = self.quarantine.rows.get(row)  # (epoch, position) its quarantine began, or None
        for epoch, end in self._epochs(self.rows if self.rows is not None else row + 1):
            if row >= end:
                continue
            if self.skips.contains(epoch, row):
                skipped.append(epoch)
            elif since is not None and (epoch, row) >= since:
                held.append(epoch)
            else:
                epochs.append(epoch)
        return LedgerAnswer(source, row, len(epochs), tuple(epochs), tuple(skipped), tuple(held))


def ledger_of_checkpoint(state: Mapping[str, Any]) -> Ledger:
    """The `Ledger` of a checkpoint's saved state (plain data: its ``timestamp`` and ``callbacks``).

    The skip list is the `SpikeGuard`'s (none: nothing skipped); the order is the `MixtureCounts`'
    mixture, seed and stage starts (a mixture run), else the plain dataset in its own order.
    """
    timestamp = state.get("timestamp")
    if not isinstance(timestamp, Mapping):
        raise ValueError("The checkpoint holds no Timestamp: is it a training checkpoint of this project?")
    callbacks = state.get("callbacks") or {}
    guard = next((v for k, v in callbacks.items() if k.split("#")[0] == "SpikeGuard"), None)
    skips = SkipList.from_state_dict(guard["skips"]) if guard else SkipList()
    quarantine = Quarantine.from_state_dict(guard.get("quarantine", {})) if guard else Quarantine()
    counts = next((v for k, v in callbacks.items() if k.split("#")[0] == "MixtureCounts"), None)
    epoch, position = int(timestamp["epoch"]), int(timestamp["sample_in_epoch"])
    if counts is None:
        return Ledger.plain(None, epoch=epoch, position=position, skips=skips, quarantine=quarantine)
    return Ledger(
        plan=saved_plan(counts["mixture"], counts["seed"], counts["stage_starts"]),
        epoch=epoch,
        position=position,
        skips=skips,
        quarantine=quarantine,  # answered where its ids number the mixture's rows (row_ids="mixture")
    )


def saved_plan(mixture: Mapping[str, Any], seed: int, stage_starts: Sequence[int]) -> MixturePlan:
    """The `MixturePlan` a checkpoint's `MixtureCounts` describes: its stages placed at their saved starts in
    samples (a 'dur' stage's start depended on the run's length, which the checkpoint does not keep)."""
    stages = dict(mixture["stages"])
    if len(stages) != len(stage_starts):
        raise ValueError(f"The checkpoint's mixture has {len(stages)} stages but {len(stage_starts)} saved starts.")
    placed = dict(mixture)
    renamed = {key: f"{start}sp" for key, start in zip(stages, stage_starts)}
    placed["stages"] = {renamed[key]: weights for key, weights in stages.items()}
    if mixture.get("switches"):
        placed["switches"] = [renamed[key] for key in mixture["switches"]]
    return Mixture.from_dict(placed).plan(seed=int(seed))
