"""Row-level shuffle of the global order: rows permuted within windows of consecutive blocks.

The epoch's stream of blocks (in the dataset's order, or with its blocks permuted by seed + epoch)
is cut into windows: consecutive blocks until a window holds at least ``window_rows`` rows (the
last window may hold fewer). Rows are permuted within each window by a permutation drawn from
``(seed, epoch, window number)`` -- the idea of MosaicML Streaming's ``py1b``. So:

* deterministic in (seed, epoch) and independent of the world size: the windows and their
  permutations depend on the stream alone, and the global batches are cut from the shuffled order
  exactly as from the plain one (any world size sees the same global batches);
* resumable at any position: global row ``i`` is row ``perm_w[i - start_w]`` of window ``w``;
  a resumed epoch passes over the windows before its position (never held);
* no extra network bytes over the plain order with rows of a few KiB, where each node already
  needs a row of nearly every block; memory: a window's blocks are held until every rank is past
  the window.

`WindowIndex` has the interface of `row_index.BlockIndex` (``end``, ``skip``, ``slices``, ``trim``,
``first_row``, ``len``) with whole windows appended; its slices are `slices.Take` values: output
row ``j`` is row ``rows[j]`` of block ``refs[which[j]]``.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raytrain_events.data.ray.slices import Take

__all__ = ["WindowIndex", "window_permutation"]


def window_permutation(seed: int, epoch: int, window: int, rows: int) -> np.ndarray:
    """The permutation of window ``window``'s ``rows`` rows in epoch ``epoch`` (a pure function)."""
    return np.random.default_rng([seed, epoch, window]).permutation(rows)


class _Window:
    __slots__ = ("number", "refs", "offsets", "starts", "rows", "perm")

    def __init__(self, number: int, blocks: Sequence[Tuple[Any, int, int]]) -> None:
        self.number = number
        self.refs = [ref for ref, _, _ in blocks]
        self.offsets = np.array([offset for _, offset, _ in blocks], dtype=np.int64)
        counts = np.array([count for _, _, count in blocks], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.rows = int(counts.sum())
        self.perm: Optional[np.ndarray] = None


class WindowIndex:
    """Whole shuffle windows of one epoch, looked up by global row (see module doc)."""

    def __init__(self, seed: int, epoch: int, start: int = 0, windows: int = 0) -> None:
        """``start``, ``windows``: the global row and window number the stream starts at (a seek)."""
        self.seed, self.epoch = seed, epoch
        self._starts: List[int] = []  # global row each held window starts at
        self._windows: List[Any] = []  # _Window, None once trimmed
        self._head = 0
        self.windows = windows  # windows seen so far (held or passed over)
        self.end = start
        self._blocks = 0

    def __len__(self) -> int:
        """Blocks held."""
        return self._blocks

    def append_window(self, blocks: Sequence[Tuple[Any, int, int]]) -> None:
        """The next window: ``(ref, first row, rows)`` of each of its blocks, in stream order."""
        window = _Window(self.windows, blocks)
        self._starts.append(self.end)
        self._windows.append(window)
        self.windows += 1
        self.end += window.rows
        self._blocks += len(window.refs)

    def skip(self, count: int) -> None:
        """The next window, of ``count`` rows, is passed over (before the epoch's position)."""
        self.windows += 1
        self.end += count

    def first_row(self) -> int:
        """The oldest global row still held (``end`` when nothing is)."""
        return self._starts[self._head] if self._head < len(self._starts) else self.end

    def slices(self, a: int, b: int) -> List[Take]:
        """Takes that give global rows ``[a, b)`` of the shuffled order, in order."""
        if a >= b:
            return []
        if a < self.first_row():
            raise LookupError(f"rows from {a} were dropped (the oldest held row is {self.first_row()})")
        i = bisect_right(self._starts, a, self._head) - 1
        out: List[Take] = []
        while i < len(self._starts) and self._starts[i] < b:
            start, window = self._starts[i], self._windows[i]
            if window.perm is None:
                window.perm = window_permutation(self.seed, self.epoch, window.number, window.rows)
            lo, hi = max(a, start) - start, min(b, start + window.rows) - start
            source = window.perm[lo:hi]  # rows of the window, in the window's stream order
            which = np.searchsorted(window.starts, source, side="right") - 1
            rows = window.offsets[which] + source - window.starts[which]
            # One entry per distinct block: slices of one block (row groups of one read) share it.
            refs: Dict[Any, int] = {}
            remap = np.full(len(window.refs), -1, dtype=np.int64)
            for j in np.unique(which).tolist():
                remap[j] = refs.setdefault(window.refs[j], len(refs))
            out.append(Take(list(refs), remap[which], rows))
            i += 1
        return out

    def trim(self, row: int) -> None:
        """Drop the windows that end at or before global row ``row``."""
        while self._head < len(self._starts) and self._starts[self._head] + self._windows[self._head].rows <= row:
            self._blocks -= len(self._windows[self._head].refs)
            self._windows[self._head] = None  # release the refs now
            self._head += 1
        if self._head > 64 and self._head * 2 > len(self._starts):
            del self._starts[: self._head], self._windows[: self._head]
            self._head = 0
