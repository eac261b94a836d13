"""`Ledger`: was row ``N`` of source ``S`` trained before a checkpoint, and how many times?

No per-row log: the answer is computed from what already fixes the run's order: the `MixturePlan`
(mixture, seed; ``core/mixture_plan.py``), the checkpoint's `Timestamp` (epoch and position) and the
`SkipList` of the `SpikeGuard` (``core/spikes.py``). In epoch ``e`` source ``i`` gives its ``t``-th row
as row ``permute(t mod rows, rows, key(e, i, t // rows))``; the ledger runs that keyed Feistel
permutation backwards (`inverse_permute`) to find at which read ``t`` each pass of epoch ``e`` gives
row ``N``, then asks whether that read is before the checkpoint's cursor (`MixturePlan.cursors`) and
outside every skipped window (a window ``[a, b)`` of positions is the reads
``[cursors(e, a)[i], cursors(e, b)[i])`` of source ``i``).

Cost: per epoch one cursor walk (O(sources x log(epoch))) and one inverse permutation per pass over
the source, whatever the run's size (1e9 rows: ``bench/ledger.py``); state: the mixture, the seed,
the timestamp and the skip list (bytes, not rows).

A run without a mixture trains a plain dataset in its own order (no shuffle): position = row, one
source (`Ledger.plain`). A shuffled plain dataset's order depends on its block sizes at run time and
is not answered here (a `ValueError` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from raytrain_events.core.mixture_plan import MixturePlan, _mix, _round_keys, _step
from raytrain_events.core.spikes import SkipList

__all__ = ["Ledger", "LedgerAnswer", "inverse_permute"]


def inverse_permute(value: int, size: int, key: int) -> int:
    """The ``index`` with ``permute(index, size, key) == value`` (the Feistel rounds backwards, cycle-walking)."""
    if size <= 1:
        return 0
    if not 0 <= value < size:
        raise ValueError(f"Row {value} is outside the source's {size} rows.")
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    k0, k1, k2, k3 = _round_keys(key)
    x = value
    while True:
        left, right = x >> half, x & mask
        for k in (k3, k2, k1, k0):  # each round was (l, r) -> (r, l ^ f(r)): undone as (l, r) -> (r ^ f(l), l)
            left, right = right ^ (_step(k ^ left) & mask), left
        x = (left << half) | right
        if x < size:
            return x


@dataclass(frozen=True)
class LedgerAnswer:
    """``times``: how often the row was trained before the checkpoint; ``epochs``: in which epochs (one entry
    per training); ``skipped``: the epochs whose skipped windows held it."""

    source: str
    row: int
    times: int
    epochs: Tuple[int, ...]
    skipped: Tuple[int, ...]

    @property
    def trained(self) -> bool:
        return self.times > 0

    def line(self) -> str:
        where = f" (epochs {', '.join(map(str, self.epochs))})" if self.epochs else ""
        skipped = f"; skipped by a rollback in epochs {', '.join(map(str, self.skipped))}" if self.skipped else ""
        return f"{self.source}:{self.row} trained {self.times} times before the checkpoint{where}{skipped}"


class Ledger:
    """Answers for one checkpoint: its position (``epoch``, ``sample_in_epoch``), the run's order and skips.

    Example::

        ledger = Ledger(plan=mixture.plan(seed=0), epoch=2, position=512, skips=guard.skips)
        ledger.ask("web", 123).times        # 0, 1, 2 or 3

    ``plan`` None: a plain unshuffled dataset of ``rows`` rows named ``source`` (`Ledger.plain`).
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
    ) -> None:
        if plan is None and rows is None:
            raise ValueError("A ledger needs the run's MixturePlan, or the row count of its plain unshuffled dataset.")
        self.plan, self.epoch, self.position = plan, int(epoch), int(position)
        self.skips = skips if skips is not None else SkipList()
        self.rows, self.source = rows, source

    @classmethod
    def plain(
        cls, rows: int, *, epoch: int, position: int, skips: Optional[SkipList] = None, shuffled: bool = False
    ) -> Ledger:
        """The ledger of a run over one dataset in its own order (position = row)."""
        if shuffled:
            raise ValueError(
                "A shuffled plain dataset's order depends on its block sizes at run time; the ledger answers for "
                "a Mixture (its order is a function of the seed) or an unshuffled dataset."
            )
        return cls(plan=None, epoch=epoch, position=position, skips=skips, rows=rows)

    def _epochs(self) -> List[Tuple[int, int]]:
        """``(epoch, positions trained in it before the checkpoint)`` for every epoch up to the checkpoint's."""
        size = self.plan.epoch_size if self.plan is not None else self.rows
        assert size is not None
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
        if not 0 <= row < rows:
            raise ValueError(f"Row {row} is outside source {source!r}'s {rows} rows.")
        epochs: List[int] = []
        skipped: List[int] = []
        for epoch, end in self._epochs():
            taken = plan.cursors(epoch, end)[i]
            windows = [
                (plan.cursors(epoch, r.start)[i], plan.cursors(epoch, min(r.end, end))[i])
                for r in self.skips.ranges
                if r.epoch == epoch and r.start < end
            ]
            for pass_ in range(-(-taken // rows)):
                t = pass_ * rows + inverse_permute(row, rows, _mix(plan.seed, epoch, i, pass_))
                if t >= taken:
                    continue
                if any(lo <= t < hi for lo, hi in windows):
                    skipped.append(epoch)
                else:
                    epochs.append(epoch)
        return LedgerAnswer(source, row, len(epochs), tuple(epochs), tuple(skipped))

    def _ask_plain(self, source: str, row: int) -> LedgerAnswer:
        assert self.rows is not None
        if source != self.source:
            raise ValueError(f"No source {source!r} in this run (its one dataset is {self.source!r}).")
        if not 0 <= row < self.rows:
            raise ValueError(f"Row {row} is outside the dataset's {self.rows} rows.")
        epochs: List[int] = []
        skipped: List[int] = []
        for epoch, end in self._epochs():
            if row >= end:
                continue
            (skipped if self.skips.contains(epoch, row) else epochs).append(epoch)
        return LedgerAnswer(source, row, len(epochs), tuple(epochs), tuple(skipped))
