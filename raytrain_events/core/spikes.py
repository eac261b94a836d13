"""Loss spikes as pure decisions: `SpikeDetector` (is this batch a spike?), `SkipList` (the rows a
rollback skipped, as ranges of each epoch's global order) and `RollbackPolicy` (roll back again, or stop).

No torch, no I/O: the guard that acts on them is `raytrain_events.callbacks.spike_guard.SpikeGuard`.

What counts as a spike, and the defaults (each a peer's):

* a loss or gradient norm that is not finite (NaN/inf; every peer stops or skips on it);
* a loss above ``loss_ratio`` times the mean of the trailing ``window`` accepted losses:
  llm-foundry's ``KillLossSpike`` flags a loss over ``outlier_multiplier=2`` times its running
  window (``window_size=100``); Lightning's ``SpikeDetection`` compares with a running mean over a
  window of 10 with ``rtol=2.0``. Defaults here: ``loss_ratio=2.0``, ``window=100``;
* a gradient norm more than ``grad_zscore`` standard deviations above the mean of the trailing
  window: ZClip (Kumar et al., 2025, arXiv 2504.02507) uses a z-score of the gradient norm over
  an exponential average, ``z_thresh=2.5``, to *clip*; a rollback costs a window of batches, so the
  default here is stricter: ``grad_zscore=6.0``;
* nothing is judged before ``warmup`` accepted batches (Lightning's ``warmup=1``; 10 here, because
  the first losses of a run fall fast and a ratio against two values means little).

A batch judged a spike is never added to the window, so the statistics stay those of good batches.

Skipping: a rollback restores the state before batch ``s`` and goes on *at the current position*, so
the rows of the batches between (``[s, now)`` of the global order) are skipped, never trained. The
`Timestamp` keeps counting positions (trained + skipped: a schedule in ``dur`` means the same as in
a run without the spike); the `SkipList` holds what was skipped, so ``trained = timestamp - skipped``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from math import isfinite  # (a name lookup less per batch than math.isfinite)
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from raytrain_events.core.timestamp import Timestamp

__all__ = [
    "GroupVerdict",
    "RollbackPolicy",
    "Skipped",
    "SkipList",
    "SkipRange",
    "SpikeDetector",
    "SpikeRollbackError",
    "Verdict",
    "group_vote",
    "read_group_votes",
    "window_ranges",
    "window_record",
]


class SpikeRollbackError(RuntimeError):
    """A spike came back after the allowed rollbacks (or the window grew past its bound)."""


@dataclass(frozen=True)
class Verdict:
    """Why a batch is a spike (``reason``) and the values judged; `SpikeDetector.observe` returns None for a good one."""

    reason: str
    loss: float
    grad_norm: Optional[float]


def _positive(name: str, value: Any, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name}={value!r} must be {kind}; pass e.g. {name}={'10' if integer else '2.0'}.")


class SpikeDetector:
    """Judges each batch's loss and gradient norm against the trailing window of good batches.

    Example::

        detector = SpikeDetector(window=100, loss_ratio=2.0, grad_zscore=6.0)
        verdict = detector.observe(loss=2.3, grad_norm=0.8)   # None: a good batch, added to the window
        if verdict is not None: ...                           # e.g. Verdict("loss 9.1 > 2.0 x mean 2.3", ...)

    ``loss_ratio`` or ``grad_zscore`` None turns that test off (non-finite values are always spikes).
    """

    def __init__(
        self,
        *,
        window: int = 100,
        loss_ratio: Optional[float] = 2.0,
        grad_zscore: Optional[float] = 6.0,
        warmup: int = 10,
    ) -> None:
        _positive("window", window, integer=True)
        _positive("warmup", warmup, integer=True)
        if loss_ratio is not None:
            _positive("loss_ratio", loss_ratio)
            if loss_ratio <= 1:
                raise ValueError(f"loss_ratio={loss_ratio!r} must be > 1 (a loss above ratio x mean is a spike).")
        if grad_zscore is not None:
            _positive("grad_zscore", grad_zscore)
        if warmup > window:
            raise ValueError(f"warmup={warmup} is longer than window={window}: lower warmup or raise window.")
        self.window, self.warmup = int(window), int(warmup)
        self.loss_ratio, self.grad_zscore = loss_ratio, grad_zscore
        self._losses: Deque[float] = deque(maxlen=self.window)
        self._norms: Deque[float] = deque(maxlen=self.window)
        self._loss_sum = self._norm_sum = self._norm_sq = 0.0  # running sums over the windows
        self._pushed = 0

    @property
    def loss_mean(self) -> float:
        """The trailing window's mean loss (0.0 before any good batch)."""
        return self._loss_sum / len(self._losses) if self._losses else 0.0

    def judge(self, loss: float, grad_norm: Optional[float] = None) -> Optional[Verdict]:
        """The verdict on one batch, without adding it to the window."""
        if not isfinite(loss):
            return Verdict(f"loss {loss} is not finite", loss, grad_norm)
        if grad_norm is not None and not isfinite(grad_norm):
            return Verdict(f"gradient norm {grad_norm} is not finite", loss, grad_norm)
        count = len(self._losses)
        if count < self.warmup:
            return None
        if self.loss_ratio is not None:
            mean = self._loss_sum / count
            if mean > 0 and loss > self.loss_ratio * mean:
                return Verdict(f"loss {loss:.4g} > {self.loss_ratio:g} x trailing mean {mean:.4g}", loss, grad_norm)
        if self.grad_zscore is not None and grad_norm is not None and len(self._norms) >= self.warmup:
            n = len(self._norms)
            mean = self._norm_sum / n
            std = math.sqrt(max(self._norm_sq / n - mean * mean, 0.0))
            # A window of equal norms has std 0: then any rise of more than 1e-6 relative counts.
            scale = max(std, 1e-6 * max(abs(mean), 1e-12))
            z = (grad_norm - mean) / scale
            if z > self.grad_zscore:
                return Verdict(
                    f"gradient norm {grad_norm:.4g} is {z:.1f} standard deviations above the trailing mean "
                    f"{mean:.4g} (threshold {self.grad_zscore:g})",
                    loss,
                    grad_norm,
                )
        return None

    def observe(self, loss: float, grad_norm: Optional[float] = None) -> Optional[Verdict]:
        """`judge` the batch; a good one joins the trailing window (running sums: O(1) a batch)."""
        verdict = self.judge(loss, grad_norm)
        if verdict is None:
            self._push_loss(float(loss))
            if grad_norm is not None:
                self._push_norm(float(grad_norm))
        return verdict

    def _push_loss(self, value: float) -> None:
        if len(self._losses) == self.window:
            self._loss_sum -= self._losses[0]
        self._losses.append(value)
        self._loss_sum += value

    def _push_norm(self, value: float) -> None:
        if len(self._norms) == self.window:
            old = self._norms[0]
            self._norm_sum -= old
            self._norm_sq -= old * old
        self._norms.append(value)
        self._norm_sum += value
        self._norm_sq += value * value
        self._pushed += 1
        if self._pushed % self.window == 0:  # exact sums again once a window: no drift from the subtractions
            self._norm_sum = math.fsum(self._norms)
            self._norm_sq = math.fsum(v * v for v in self._norms)
            self._loss_sum = math.fsum(self._losses)

    def state_dict(self) -> Dict[str, Any]:
        return {"losses": list(self._losses), "norms": list(self._norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._losses, self._norms = deque(maxlen=self.window), deque(maxlen=self.window)
        self._loss_sum = self._norm_sum = self._norm_sq = 0.0
        for value in state.get("losses", ())[-self.window :]:
            self._push_loss(float(value))
        for value in state.get("norms", ())[-self.window :]:
            self._push_norm(float(value))


@dataclass(frozen=True, order=True)
class SkipRange:
    """Rows ``[start, end)`` of epoch ``epoch``'s global order, skipped (``batches`` global batches, ``tokens`` tokens).

    Positions are global sample positions (`Timestamp.sample_in_epoch`), the same at any world size.
    """

    epoch: int
    start: int
    end: int
    batches: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.start < 0 or self.end <= self.start or self.batches < 0 or self.tokens < 0:
            raise ValueError(f"Not a skip range: {self!r} (need 0 <= start < end, counts >= 0).")

    @property
    def samples(self) -> int:
        return self.end - self.start

    def contains(self, epoch: int, position: int) -> bool:
        return epoch == self.epoch and self.start <= position < self.end

    def describe(self) -> str:
        return f"epoch {self.epoch} rows [{self.start}, {self.end})"


@dataclass
class SkipList:
    """The run's skipped rows: `SkipRange` s in order, never overlapping; saved in every checkpoint.

    ``fingerprint`` names the data the positions refer to (the guard stores the train set's size and
    the run's seed); a list loaded into a run on other data is refused (`check_fingerprint`).
    """

    ranges: List[SkipRange] = field(default_factory=list)
    fingerprint: Dict[str, Any] = field(default_factory=dict)

    def add(self, new: SkipRange) -> None:
        """Record ``new``; it must not overlap a range already skipped (a rollback skips only trained rows)."""
        for old in self.ranges:
            if old.epoch == new.epoch and old.start < new.end and new.start < old.end:
                raise ValueError(f"Skip range {new.describe()} overlaps {old.describe()}, already skipped.")
        self.ranges.append(new)
        self.ranges.sort()

    def contains(self, epoch: int, position: int) -> bool:
        return any(r.contains(epoch, position) for r in self.ranges)

    def totals(self, before_epoch: Optional[int] = None) -> Tuple[int, int, int]:
        """``(batches, samples, tokens)`` skipped (in epochs before ``before_epoch``, if given)."""
        chosen = [r for r in self.ranges if before_epoch is None or r.epoch < before_epoch]
        return sum(r.batches for r in chosen), sum(r.samples for r in chosen), sum(r.tokens for r in chosen)

    def describe(self) -> str:
        return ", ".join(r.describe() for r in self.ranges) or "nothing"

    def check_fingerprint(self, fingerprint: Mapping[str, Any]) -> None:
        """Refuse a skip list recorded on other data (another train set size, seed or mixture)."""
        differ = {k: (self.fingerprint[k], fingerprint[k]) for k in fingerprint if k in self.fingerprint}
        differ = {k: v for k, v in differ.items() if v[0] != v[1]}
        if differ:
            raise ValueError(
                f"The skip list was recorded for other data ({', '.join(f'{k}: {a!r} there, {b!r} here' for k, (a, b) in differ.items())}): "
                "its positions would skip the wrong rows. Start the run without it (a new run_name), or on the data it was recorded on."
            )

    def state_dict(self) -> Dict[str, Any]:
        rows = [[r.epoch, r.start, r.end, r.batches, r.tokens] for r in self.ranges]
        return {"ranges": rows, "fingerprint": dict(self.fingerprint)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> SkipList:
        out = cls(fingerprint=dict(state.get("fingerprint", {})))
        for row in state.get("ranges", ()):
            out.add(SkipRange(*(int(v) for v in row)))
        return out


@dataclass
class Skipped:
    """Rows at positions of the global order that were *not* trained, beside the `Timestamp` (``State.skipped``).

    The Timestamp counts positions (trained + not trained: a schedule in ``dur`` means what it means in a
    run without spikes, and a resume re-enters at the same place at any world size); this record counts the
    positions that were not trained, apart: ``batches``/``samples``/``tokens`` of rolled-back windows (the
    `SkipList`'s totals), ``by_source`` their samples per mixture source, and ``quarantined``/
    ``quarantined_tokens`` the rows a quarantine dropped from batches (bisection's culprits included) and
    their tokens (counted by the loop's token counter, or a mixture's ``tokens_of_row``), with
    ``quarantined_by_source`` their rows per mixture source. ``trained = timestamp - skipped - quarantined``
    (`trained`). Saved in the checkpoint with the State; a checkpoint from before it (or its quarantine
    fields) loads as zeros (the `SpikeGuard` fills the windows from its skip list then).
    """

    batches: int = 0
    samples: int = 0
    tokens: int = 0
    quarantined: int = 0
    by_source: Dict[str, int] = field(default_factory=dict)
    quarantined_tokens: int = 0
    quarantined_by_source: Dict[str, int] = field(default_factory=dict)

    def add_window(
        self, batches: int, samples: int, tokens: int, by_source: Optional[Mapping[str, int]] = None
    ) -> None:
        self.batches, self.samples, self.tokens = self.batches + batches, self.samples + samples, self.tokens + tokens
        _add_counts(self.by_source, by_source)

    def add_quarantined(self, rows: int, tokens: int, by_source: Optional[Mapping[str, int]] = None) -> None:
        """Count rows a quarantine kept out (negative counts: rows that a rolled-back window now counts instead)."""
        self.quarantined, self.quarantined_tokens = self.quarantined + rows, self.quarantined_tokens + tokens
        _add_counts(self.quarantined_by_source, by_source)

    def trained(self, batch: int, sample: int, token: int) -> Dict[str, int]:
        """What was trained of a Timestamp's totals (``batch``, ``sample``, ``token``)."""
        return {
            "batch": batch - self.batches,
            "sample": sample - self.samples - self.quarantined,
            "token": token - self.tokens - self.quarantined_tokens,
        }

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "batches": self.batches,
            "samples": self.samples,
            "tokens": self.tokens,
            "quarantined": self.quarantined,
            "by_source": dict(self.by_source),
        }
        if self.quarantined_tokens or self.quarantined_by_source:  # a run without them saves what it saved before
            out["quarantined_tokens"] = self.quarantined_tokens
            out["quarantined_by_source"] = dict(self.quarantined_by_source)
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Skipped:
        plain = {k: int(state.get(k, 0)) for k in ("batches", "samples", "tokens", "quarantined", "quarantined_tokens")}
        return cls(
            **plain,
            by_source={str(k): int(v) for k, v in dict(state.get("by_source", {})).items()},
            quarantined_by_source={str(k): int(v) for k, v in dict(state.get("quarantined_by_source", {})).items()},
        )


def _add_counts(into: Dict[str, int], counts: Optional[Mapping[str, int]]) -> None:
    """Add per-source counts (a count that reaches 0 is dropped: no source shows with nothing)."""
    for name, count in (counts or {}).items():
        total = into.get(name, 0) + int(count)
        if total:
            into[name] = total
        else:
            into.pop(name, None)


class RollbackPolicy:
    """When to stop rolling back: after ``max_rollbacks`` rollbacks, or when a window would pass
    ``max_window`` batches (a spike that follows its rollback within the window widens it)."""

    def __init__(self, *, max_rollbacks: int = 5, max_window: int = 1000) -> None:
        _positive("max_rollbacks", max_rollbacks, integer=True)
        _positive("max_window", max_window, integer=True)
        self.max_rollbacks, self.max_window = int(max_rollbacks), int(max_window)

    def check(self, rollbacks_done: int, window_batches: int, skips: SkipList, spike: str) -> None:
        """Raise `SpikeRollbackError` if the next rollback (of ``window_batches`` batches) is not allowed."""
        if rollbacks_done >= self.max_rollbacks:
            raise SpikeRollbackError(
                f"A loss spike ({spike}) after {rollbacks_done} rollbacks (max_rollbacks={self.max_rollbacks}); "
                f"skipped so far: {skips.describe()}. The data there or the learning rate needs a look; "
                "raise max_rollbacks to keep going."
            )
        if window_batches > self.max_window:
            raise SpikeRollbackError(
                f"A loss spike ({spike}) would skip {window_batches} batches (max_window={self.max_window}); "
                f"skipped so far: {skips.describe()}. Lower snapshot_interval or raise max_window."
            )


def window_record(ts: Timestamp, samples: int, tokens: int) -> Tuple[int, int, int, int, int]:
    """A batch's ``(batch, epoch, start, end, tokens)`` in the global order, from the Timestamp after it."""
    end = int(ts.sample_in_epoch)
    return ts.get_value("ba"), int(ts.epoch), end - samples, end, tokens


def window_ranges(history: List[Tuple[int, int, int, int, int]]) -> List[Tuple[int, int, int, int, int]]:
    """Consecutive batch records as ``(epoch, start, end, batches, tokens)`` ranges of the global order."""
    out: List[List[int]] = []
    for _, epoch, start, end, tokens in history:
        if out and out[-1][0] == epoch and out[-1][2] == start:
            out[-1][2] = end
            out[-1][3] += 1
            out[-1][4] += tokens
        else:
            out.append([epoch, start, end, 1, tokens])
    return [(e, s, t, b, k) for e, s, t, b, k in out]


# --------------------------------------------------------------------------- replica groups
#: A group's vote: the spike flag, then ``since_snapshot`` in base-64 limbs, each with its square (see `group_vote`).
_LIMB_BITS, _LIMBS = 6, 4
MAX_SINCE_SNAPSHOT = 1 << (_LIMB_BITS * _LIMBS)  # 2**24 batches between a step and its newest snapshot


@dataclass(frozen=True)
class GroupVerdict:
    """What every replica group reads from the summed votes of a committed step (`read_group_votes`): whether
    some group judged the step a spike, and whether every group's newest host snapshot is of the same step."""

    spike: bool
    same_snapshot: bool


def group_vote(spike: bool, since_snapshot: int) -> List[int]:
    """This replica group's vote on a step, summed over the step's participants with its gradients (torchft).

    ``spike``: this group judged the step's loss (or gradient norm) a spike. ``since_snapshot``: the step's
    batch less its newest host snapshot's (the snapshot every group would restore). The sum of the flags says
    whether any group saw a spike; the sums of ``since_snapshot``'s base-64 limbs and of their squares say
    whether every group holds the same newest snapshot (``n * sum(x*x) == sum(x)**2`` exactly when all ``n``
    values of ``x`` are equal: Cauchy-Schwarz), with small integers only: each sum stays exact in float32
    (under 2**23) up to 2,000 groups. Seven integers in all.
    """
    if isinstance(since_snapshot, bool) or not 0 <= since_snapshot < MAX_SINCE_SNAPSHOT:
        raise ValueError(f"since_snapshot={since_snapshot!r} must be in [0, {MAX_SINCE_SNAPSHOT}) batches.")
    out = [1 if spike else 0]
    for i in range(_LIMBS):
        limb = (since_snapshot >> (_LIMB_BITS * i)) & ((1 << _LIMB_BITS) - 1)
        out += [limb, limb * limb]
    return out


def read_group_votes(sums: Sequence[int], groups: int) -> GroupVerdict:
    """The verdict from the `group_vote` s of ``groups`` participants summed: the same on every group (each
    reads the same sums), whatever it voted itself."""
    if len(sums) != 1 + 2 * _LIMBS or groups < 1:
        raise ValueError(f"Not the sums of group votes: {list(sums)!r} over {groups} groups.")
    same = all(groups * sums[2 + 2 * i] == sums[1 + 2 * i] ** 2 for i in range(_LIMBS))
    return GroupVerdict(spike=sums[0] > 0, same_snapshot=same)
