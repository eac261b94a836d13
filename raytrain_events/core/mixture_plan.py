"""`MixturePlan`: which source and row each global sample position of an epoch reads.

Positions are global (the same for any number of workers): epoch ``e``'s position ``p`` is the
run's plan coordinate ``e * epoch_size + p``. The stages cut each epoch into segments; a segment
of length ``L`` under weights ``w`` holds ``quota_i`` rows of source ``i`` (``L`` apportioned by
``w``, largest remainders). Inside a segment the sources are interleaved by a deterministic
split tree: each node halves its range and gives the left half its share of every source's
count (largest remainders, ties broken by a hash of (seed, epoch, node)); leaves of at most
`LEAF` positions are shuffled with the same hash. So

* any prefix of a segment holds each source within a few rows of its proportion,
* a source's *cursor* (its rows taken before a position) is the sum of the earlier segments'
  quotas plus one walk down the tree: O(sources * log(L)) with nothing read or enumerated,
* the ``t``-th row taken from source ``i`` in epoch ``e`` is row ``perm(t mod rows)`` of a
  keyed permutation of the source (a Feistel network, no table), a fresh one per pass: every
  chosen row once per epoch, and a source asked for more rows than it has goes round again
  only after all of them.

Everything is a function of (mixture, seed, epoch, position), in pure Python integers: no
global RNG, no numpy stream, the same plan on every host and every world size.

`MixturePlan.batch_sources` is the order a Ray run streams: the same positions per global batch,
each batch's listed source by source (one run per source instead of runs of 1-3 positions), so
a rank's part of a batch is one or two slices of its sources' blocks; the local `MixtureLoader`
reads rows one by one and keeps the plan's interleaved order.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from raytrain_events.core.time import TimeUnit

if TYPE_CHECKING:
    from raytrain_events.core.mixture import Mixture

__all__ = [
    "MixturePlan",
    "MixtureRun",
    "Segment",
    "LEAF",
    "apportion",
    "inverse_permute",
    "pass_key",
    "permute",
    "run_samples",
]

LEAF = 64  # positions shuffled as one block at the bottom of the split tree
_M64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 64-bit hash of ints (splitmix64 steps): the plan's only source of randomness."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


def _step(h: int) -> int:
    """One splitmix64 step: the Feistel network's round function."""
    h = (h + 0x9E3779B97F4A7C15) & _M64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


def apportion(total: int, weights: Sequence[Fraction], key: int = 0) -> List[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; ties by a hash of ``key``)."""
    weight_sum = sum(weights)
    exact = [w * total / weight_sum for w in weights]
    counts = [int(x) for x in exact]  # floors: the weights are >= 0
    left = total - sum(counts)
    order = sorted(
        (i for i, x in enumerate(exact) if x != counts[i]), key=lambda i: (-(exact[i] - counts[i]), _mix(key, i))
    )
    for i in order[:left]:
        counts[i] += 1
    return counts


def _split(counts: Sequence[int], length: int, left: int, node: Tuple[int, int, int]) -> List[int]:
    """The left part (``left`` of ``length`` positions) of ``counts``: each count's share, largest remainders
    (ties broken by the hash of ``node``, (root, lo, hi), computed only when there is a remainder)."""
    floors = [c * left // length for c in counts]
    extra = left - sum(floors)
    if extra:
        key = _mix(*node)
        order = sorted(
            (i for i, c in enumerate(counts) if (c * left) % length),
            key=lambda i: (-((counts[i] * left) % length), _mix(key, i)),
        )
        for i in order[:extra]:
            floors[i] += 1
    return floors


@lru_cache(maxsize=1024)  # consecutive batches (and ranks' cursors) touch the same few leaves
def _shuffled_leaf(counts: Tuple[int, ...], key: int) -> Tuple[int, ...]:
    """The source of each position of a leaf: ``counts`` as a multiset, in a keyed Fisher-Yates order."""
    out = [i for i, c in enumerate(counts) for _ in range(c)]
    for j in range(len(out) - 1, 0, -1):
        k = _step(key ^ j) % (j + 1)
        out[j], out[k] = out[k], out[j]
    return tuple(out)


@lru_cache(maxsize=4096)
def _round_keys(key: int) -> Tuple[int, int, int, int]:
    return (_mix(key, 0), _mix(key, 1), _mix(key, 2), _mix(key, 3))


def permute(index: int, size: int, key: int) -> int:
    """``index`` through a keyed bijection of ``range(size)`` (a 4-round Feistel network, cycle-walking)."""
    if size <= 1:
        return 0
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    k0, k1, k2, k3 = _round_keys(key)
    x = index
    while True:
        left, right = x >> half, x & mask
        left, right = right, left ^ (_step(k0 ^ right) & mask)
        left, right = right, left ^ (_step(k1 ^ right) & mask)
        left, right = right, left ^ (_step(k2 ^ right) & mask)
        left, right = right, left ^ (_step(k3 ^ right) & mask)
        x = (left << half) | right
        if x < size:
            return x


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


def pass_key(seed: int, epoch: int, source: int, pass_: int) -> int:
    """The permutation key of a source's ``pass_``-th pass over its rows in ``epoch`` (`MixturePlan.row`)."""
    return _mix(seed, epoch, source, pass_)


def run_samples(max_duration: Any, epoch_size: int, global_batch: Optional[int]) -> Optional[int]:
    """The run's length in samples (for 'dur' stages): from ``max_duration`` in 'ep', 'sp' or 'ba'; else None."""
    if max_duration is None:
        return None
    unit, value = max_duration.unit, int(max_duration.value)
    if unit == TimeUnit.EPOCH:
        return value * epoch_size
    if unit == TimeUnit.SAMPLE:
        return value
    if unit == TimeUnit.BATCH and global_batch is not None:
        return value * global_batch
    return None


@dataclass(frozen=True)
class MixtureRun:
    """What fixes a run's `MixturePlan` besides the sources: the mixture, the plan's seed, the run's length in
    samples (for 'dur' stages; None: unknown) and its global batch (for 'ba' stages; None: elastic). Made once
    (`RayTrainer`'s `ray/plan.RunPlan`, the local `MixtureLoader.bind`) and handed to whoever needs the order:
    the same plan on the feeder and every rank."""

    mixture: Mixture
    seed: int
    total_samples: Optional[int] = None
    global_batch: Optional[int] = None

    @classmethod
    def of(cls, mixture: Mixture, *, seed: int, max_duration: Any, global_batch: Optional[int]) -> MixtureRun:
        """The run of ``mixture`` trained for ``max_duration`` (a `Time`) in global batches of ``global_batch``."""
        assert mixture.epoch_size is not None
        return cls(mixture, seed, run_samples(max_duration, mixture.epoch_size, global_batch), global_batch)

    def plan(self) -> MixturePlan:
        """The run's order; a stage the run cannot place (after its end, out of order) fails here."""
        return MixturePlan(
            self.mixture, seed=self.seed, total_samples=self.total_samples, global_batch=self.global_batch
        )


class Segment(NamedTuple):
    """Positions [start, stop) of an epoch under one stage, with each source's quota there.

    ``extent``: the length its split tree spans (``stop - start``, or more when a switch stage cut
    the segment short: its positions keep the order they had without the switch).
    """

    start: int
    stop: int
    stage: int
    quotas: Tuple[int, ...]
    extent: int = 0


class MixturePlan:
    """A `Mixture`'s order for one run: ``source_at``/``rows`` for positions, ``cursors`` for resumes.

    Example::

        plan = mixture.plan(seed=0, total_samples=3 * mixture.epoch_size)
        plan.rows(epoch=0, start=0, stop=8)         # [(source index, row), ...] for global positions 0..7
        plan.cursors(epoch=0, position=5000)        # rows each source gave before position 5000
    """

    def __init__(
        self, mixture: Mixture, *, seed: int, total_samples: Optional[int] = None, global_batch: Optional[int] = None
    ) -> None:
        self.mixture = mixture
        self.seed = int(seed)
        assert mixture.epoch_size is not None
        self.epoch_size: int = mixture.epoch_size
        self.names = mixture.names
        self.source_rows = tuple(mixture.rows(n) for n in self.names)
        self.starts = tuple(self._resolve(start, total_samples, global_batch) for start, _ in mixture.stage_list)
        for (earlier, a), (later, b) in zip(
            zip(mixture.stage_list, self.starts), zip(mixture.stage_list[1:], self.starts[1:])
        ):
            if b <= a:
                raise ValueError(
                    f"Stage {later[0].to_timestring()!r} starts at sample {b}, not after stage "
                    f"{earlier[0].to_timestring()!r} (sample {a}): order the stages by their start in this run."
                )
        if total_samples is not None and len(self.starts) > 1 and self.starts[-1] >= total_samples:
            raise ValueError(
                f"Stage {mixture.stage_list[-1][0].to_timestring()!r} starts at sample {self.starts[-1]}, at or after "
                f"the run's end ({total_samples} samples): start it earlier or lengthen max_duration."
            )
        self.weights = tuple(tuple(amount for _, amount in amounts) for _, amounts in mixture.stage_list)
        self.switch = tuple(start.to_timestring() in mixture.switches for start, _ in mixture.stage_list)
        self._segments: Dict[int, Tuple[Segment, ...]] = {}

    def _resolve(self, start: Any, total: Optional[int], global_batch: Optional[int]) -> int:
        unit, value = start.unit, start.value
        if unit == TimeUnit.SAMPLE:
            return int(value)
        if unit == TimeUnit.EPOCH:
            return int(value) * self.epoch_size
        if unit == TimeUnit.BATCH:
            if global_batch is None:
                raise ValueError(f"Stage {start.to_timestring()!r} is in batches: give the plan its global batch size.")
            return int(value) * global_batch
        if value == 0:
            return 0
        if total is None:
            raise ValueError(
                f"Stage {start.to_timestring()!r} is a fraction of the run, whose length in samples is not known: "
                "give max_duration in 'ep', 'sp' or 'ba', or start the stage in 'sp' or 'ep'."
            )
        return int(Fraction(repr(value)) * total)  # 0.6 of 320 is 192 (the float 0.6 is a hair less)

    # ----------------------------------------------------------------- segments
    def segments(self, epoch: int) -> Tuple[Segment, ...]:
        """The epoch's stage segments, in order, with each one's per-source quota."""
        cached = self._segments.get(epoch)
        if cached is not None:
            return cached
        base, size, out = epoch * self.epoch_size, self.epoch_size, []
        for stage, begin in enumerate(self.starts):
            end = self.starts[stage + 1] if stage + 1 < len(self.starts) else None
            # A switch stage cuts this segment short without changing its order: the tree spans up to
            # the next stage that is not a switch (or the epoch's end), as it did before the switch.
            later = [s for s in range(stage + 1, len(self.starts)) if not self.switch[s]]
            natural = self.starts[later[0]] if later else None
            lo = max(begin - base, 0)
            hi = size if end is None else min(end - base, size)
            if hi > lo:
                span = (size if natural is None else min(natural - base, size)) - lo
                quotas = apportion(span, self.weights[stage], _mix(self.seed, epoch, lo))
                if span > hi - lo:
                    quotas = self._tree_prefix(epoch, lo, span, quotas, hi - lo)
                out.append(Segment(lo, hi, stage, tuple(quotas), span))
        segments = tuple(out)
        if len(self._segments) > 8:
            self._segments.clear()
        self._segments[epoch] = segments
        return segments

    def stage_at(self, epoch: int, position: int) -> int:
        """The index of the stage that position ``position`` of ``epoch`` trains under."""
        for segment in self.segments(epoch):
            if position < segment.stop:
                return segment.stage
        return self.segments(epoch)[-1].stage

    def epoch_totals(self, epoch: int) -> Tuple[int, ...]:
        """Rows each source gives in the whole epoch."""
        totals = [0] * len(self.names)
        for segment in self.segments(epoch):
            for i, quota in enumerate(segment.quotas):
                totals[i] += quota
        return tuple(totals)

    # ------------------------------------------------------------------ cursors
    def cursors(self, epoch: int, position: int) -> Tuple[int, ...]:
        """Rows each source gave in ``epoch`` before ``position``: O(sources * (segments + log(segment)))."""
        if not 0 <= position <= self.epoch_size:
            raise ValueError(f"Position {position} is outside the epoch [0, {self.epoch_size}].")
        counts = [0] * len(self.names)
        for segment in self.segments(epoch):
            if position >= segment.stop:
                part: Sequence[int] = segment.quotas
            elif position > segment.start:
                part = self._prefix(epoch, segment, position - segment.start)
            else:
                break
            for i, c in enumerate(part):
                counts[i] += c
        return tuple(counts)

    def _prefix(self, epoch: int, segment: Segment, k: int) -> List[int]:
        """Counts of each source among the first ``k`` positions of ``segment`` (a walk down its split tree)."""
        if segment.extent > segment.stop - segment.start:  # cut short by a switch: its full tree's counts
            full = apportion(segment.extent, self.weights[segment.stage], _mix(self.seed, epoch, segment.start))
            return self._tree_prefix(epoch, segment.start, segment.extent, full, k)
        return self._tree_prefix(epoch, segment.start, segment.stop - segment.start, list(segment.quotas), k)

    def _tree_prefix(self, epoch: int, start: int, span: int, quotas: Sequence[int], k: int) -> List[int]:
        """Counts of each source among the first ``k`` positions of the split tree over ``span`` positions."""
        out = [0] * len(quotas)
        lo, hi, counts = 0, span, list(quotas)
        root = _mix(self.seed, epoch, start)
        while hi - lo > LEAF:
            mid = (lo + hi) // 2
            left = _split(counts, hi - lo, mid - lo, (root, lo, hi))
            if k >= mid:
                out = [a + b for a, b in zip(out, left)]
                counts, lo = [c - b for c, b in zip(counts, left)], mid
            else:
                counts, hi = left, mid
        for source in _shuffled_leaf(tuple(counts), _mix(root, lo, hi, 1))[: k - lo]:
            out[source] += 1
        return out

    # -------------------------------------------------------------- positions
    def sources(self, epoch: int, start: int, stop: int) -> List[int]:
        """The source index of each position in [start, stop) of ``epoch``."""
        out: List[int] = []
        for segment in self.segments(epoch):
            lo, hi = max(start, segment.start), min(stop, segment.stop)
            if hi > lo:
                root = _mix(self.seed, epoch, segment.start)
                span = (lo - segment.start, hi - segment.start)
                extent = max(segment.extent, segment.stop - segment.start)
                counts = list(segment.quotas)
                if extent > segment.stop - segment.start:  # cut short by a switch: walk its full tree
                    counts = apportion(extent, self.weights[segment.stage], _mix(self.seed, epoch, segment.start))
                self._walk(root, counts, (0, extent), span, out)
        return out

    def _walk(self, root: int, counts: List[int], node: Tuple[int, int], span: Tuple[int, int], out: List[int]) -> None:
        """Append the sources of positions ``span`` (inside ``node``, whose counts are ``counts``) to ``out``."""
        (lo, hi), (start, stop) = node, span
        if hi - lo <= LEAF:
            out.extend(_shuffled_leaf(tuple(counts), _mix(root, lo, hi, 1))[start - lo : stop - lo])
            return
        mid = (lo + hi) // 2
        left = _split(counts, hi - lo, mid - lo, (root, lo, hi))
        if start < mid:
            self._walk(root, left, (lo, mid), (start, min(stop, mid)), out)
        if stop > mid:
            self._walk(root, [c - b for c, b in zip(counts, left)], (mid, hi), (max(start, mid), stop), out)

    def batch_sources(self, epoch: int, start: int, stop: int, anchor: int, window: Optional[int]) -> List[int]:
        """The sources of positions [start, stop) in the order a run trains them: each global batch's
        positions (``window`` of them, counted from ``anchor``, the position its stream entered the
        epoch at) listed by source, source by source in the plan's order of their rows (see the module doc).

        The same rows in each global batch as `sources` (a batch's gradient does not depend on
        the order of its rows), in at most one run per source: a rank's part of a batch is one or
        two slices of the sources' blocks instead of one per plan run. None: the plan's own order."""
        if not window:
            return self.sources(epoch, start, stop)
        lo = anchor + (start - anchor) // window * window
        hi = min(self.epoch_size, anchor + -(-(stop - anchor) // window) * window)
        raw = self.sources(epoch, lo, hi)
        out: List[int] = []
        for w in range(0, len(raw), window):
            out.extend(sorted(raw[w : w + window]))
        return out[start - lo : stop - lo]

    def row(self, epoch: int, source: int, taken: int) -> int:
        """The row of ``source`` that its ``taken``-th read of ``epoch`` returns (pass ``taken // rows``)."""
        rows = self.source_rows[source]
        return permute(taken % rows, rows, pass_key(self.seed, epoch, source, taken // rows))

    def read_of(self, epoch: int, source: int, row: int, pass_: int) -> int:
        """The read ``taken`` of ``source`` in ``epoch`` whose `row` is ``row``, in pass ``pass_`` (its inverse)."""
        rows = self.source_rows[source]
        return pass_ * rows + inverse_permute(row, rows, pass_key(self.seed, epoch, source, pass_))

    def rows(self, epoch: int, start: int, stop: int) -> List[Tuple[int, int]]:
        """(source index, row) for each position in [start, stop) of ``epoch``; nothing before ``start`` is enumerated."""
        stop = min(stop, self.epoch_size)
        if start >= stop:
            return []
        taken = list(self.cursors(epoch, start))
        out = []
        keys: Dict[Tuple[int, int], int] = {}  # (source, pass) -> its permutation's key
        for source in self.sources(epoch, start, stop):
            t, rows = taken[source], self.source_rows[source]
            pass_ = t // rows
            key = keys.get((source, pass_))
            if key is None:
                key = keys[(source, pass_)] = _mix(self.seed, epoch, source, pass_)
            out.append((source, permute(t % rows, rows, key)))
            taken[source] = t + 1
        return out

    # --------------------------------------------------------------- run totals
    def consumed(self, epoch: int, position: int) -> Tuple[int, ...]:
        """Rows each source gave in the whole run up to ``position`` of ``epoch`` (every earlier epoch full)."""
        totals = list(self.cursors(epoch, position))
        for earlier in range(epoch):
            for i, c in enumerate(self.epoch_totals(earlier)):
                totals[i] += c
        return tuple(totals)

    def describe(self) -> Dict[str, Any]:
        """Plain data for logs and reports: the stages' starts in samples and each stage's proportions."""
        return {
            "epoch_size": self.epoch_size,
            "stage_starts_sp": list(self.starts),
            "proportions": [
                {n: float(w / sum(weights)) for n, w in zip(self.names, weights)} for weights in self.weights
            ],
        }
