"""A rank's share of a batch, as typed slices of the epoch's blocks: `RowRange` and `Take`.

The feeder answers each rank's "which rows of which blocks make my batch?" with a list of slices
(`row_index.BlockIndex.slices` for the plain order, `shuffle.WindowIndex.slices` for a shuffled
one); the rank fetches those blocks (`block_fetch`) and builds the batch from them
(`data.GlobalOrderLoader`). Two kinds:

* `RowRange(ref, lo, hi)`: rows ``lo:hi`` of block ``ref``;
* `Take(refs, which, rows)`: output row ``j`` is row ``rows[j]`` of block ``refs[which[j]]`` (the
  rows of a shuffle window, permuted).

Both are NamedTuples: pickled as small tuples (the feeder sends one list per rank per batch),
equal by their fields, and with the methods every reader uses (`blocks`, `block_rows`, `then`),
so no reader tells the kinds apart by a tuple's length. No Ray, no torch: the feeder imports it.
"""

from __future__ import annotations

from typing import Any, Iterator, List, NamedTuple, Optional, Tuple, Union

import numpy as np

__all__ = ["RowRange", "Slice", "Take"]


class RowRange(NamedTuple):
    """Rows ``lo:hi`` of block ``ref`` (row numbers within the block)."""

    ref: Any
    lo: int
    hi: int

    def blocks(self) -> Tuple[Any, ...]:
        """The blocks this slice reads: its one block."""
        return (self.ref,)

    def block_rows(self) -> Iterator[Tuple[Any, np.ndarray]]:
        """``(block, the rows of it this slice reads)``: ``lo .. hi - 1`` of its block."""
        yield self.ref, np.arange(self.lo, self.hi, dtype=np.int64)

    def then(self, following: Slice) -> Optional[RowRange]:
        """This range and ``following`` as one range, when ``following`` goes on where this one ends
        in the same block (row groups of one read); None otherwise."""
        if isinstance(following, RowRange) and following.ref == self.ref and following.lo == self.hi:
            return RowRange(self.ref, self.lo, following.hi)
        return None


class Take(NamedTuple):
    """Rows of a few blocks in a given order: output row ``j`` is row ``rows[j]`` of block
    ``refs[which[j]]`` (``refs`` distinct; ``which`` and ``rows`` int arrays of one length)."""

    refs: List[Any]
    which: np.ndarray
    rows: np.ndarray

    def blocks(self) -> Tuple[Any, ...]:
        """The blocks this slice reads, each once."""
        return tuple(self.refs)

    def block_rows(self) -> Iterator[Tuple[Any, np.ndarray]]:
        """``(block, the rows of it this slice reads)`` for each of its blocks (in output order)."""
        rows, which = np.asarray(self.rows, dtype=np.int64), np.asarray(self.which)
        for j, ref in enumerate(self.refs):
            yield ref, rows[which == j]

    def then(self, following: Slice) -> None:
        """A take is never joined with the slice after it."""
        return None


#: One slice of a rank's batch.
Slice = Union[RowRange, Take]
