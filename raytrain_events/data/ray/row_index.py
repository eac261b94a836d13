"""`BlockIndex`: an epoch's buffered blocks, found by global row in O(log n) and trimmed from the front.

The feeder answers "which blocks hold rows ``[a, b)`` of the order?" once per rank per batch: with
512 ranks that is 512 lookups per global batch, so a lookup must not scan the buffer (the first
feeder did, 35-41 ms per call with ~8,000 buffered blocks). Blocks arrive in order, each with the
global row it starts at; a lookup bisects those starts. Blocks every rank is past are dropped from
the front (their references released, so Ray can free them) in amortized O(1): the list keeps a
head index and is compacted when the dead front is half of it.

`RankCursor` tracks the oldest batch any rank still needs from a count of ranks per batch number:
a ``min`` over the few distinct batch numbers once per global batch, where a ``min`` over 512
ranks on each call would cost more than the lookup.

Pure Python, no Ray: the feeder benchmark drives it with fake block references.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Dict, List

from raytrain_events.data.ray.slices import RowRange

__all__ = ["BlockIndex", "RankCursor"]


class BlockIndex:
    """Blocks of one order, appended in order, looked up by global row (see module doc)."""

    __slots__ = ("_starts", "_refs", "_offsets", "_counts", "_head", "end")

    def __init__(self, start: int = 0) -> None:
        self._starts: List[int] = []  # global row each block starts at (increasing)
        self._refs: List[Any] = []
        self._offsets: List[int] = []  # first row of the block that belongs to the order
        self._counts: List[int] = []
        self._head = 0  # blocks before it are dropped
        self.end = start  # global row after the last block

    def __len__(self) -> int:
        """Blocks held (those not yet trimmed)."""
        return len(self._starts) - self._head

    def append(self, ref: Any, offset: int, count: int) -> None:
        """The next ``count`` rows of the order: rows ``offset .. offset + count`` of block ``ref``."""
        self._starts.append(self.end)
        self._refs.append(ref)
        self._offsets.append(offset)
        self._counts.append(count)
        self.end += count

    def skip(self, count: int) -> None:
        """The next ``count`` rows of the order are not held (before an epoch's start position)."""
        self.end += count

    def first_row(self) -> int:
        """The oldest global row still held (``end`` when nothing is)."""
        return self._starts[self._head] if self._head < len(self._starts) else self.end

    def slices(self, a: int, b: int) -> List[RowRange]:
        """The block slices that hold global rows ``[a, b)``, in order."""
        starts, counts, head = self._starts, self._counts, self._head
        i = bisect_right(starts, a, head) - 1
        if i < head:
            if a >= b:
                return []
            if head == len(starts) or a < starts[head]:
                raise LookupError(f"rows from {a} were dropped (the oldest held row is {self.first_row()})")
            i = head
        out: List[RowRange] = []
        make = tuple.__new__  # RowRange(...) without its Python-level __new__: half the cost, on the feeder's hot path
        n = len(starts)
        while i < n:
            first = starts[i]
            if first >= b:
                break
            end = first + counts[i]
            lo = a if a > first else first
            hi = b if b < end else end
            if lo < hi:
                offset = self._offsets[i] - first
                out.append(make(RowRange, (self._refs[i], offset + lo, offset + hi)))
            i += 1
        return out

    def trim(self, row: int) -> None:
        """Drop the blocks that end at or before global row ``row``."""
        starts, counts, refs = self._starts, self._counts, self._refs
        head, n = self._head, len(starts)
        while head < n and starts[head] + counts[head] <= row:
            refs[head] = None  # release the reference now
            head += 1
        self._head = head
        if head > 64 and head * 2 > n:
            del starts[:head], refs[:head], self._offsets[:head], counts[:head]
            self._head = 0


class RankCursor:
    """Each rank's next batch number, and the oldest of them, kept in O(1) amortized per advance."""

    __slots__ = ("next", "_ranks_at", "oldest")

    def __init__(self, world_size: int, first: int = 0) -> None:
        self.next = [first] * world_size
        self._ranks_at: Dict[int, int] = {first: world_size}
        self.oldest = first

    def advance(self, rank: int, k: int) -> None:
        """Rank ``rank`` has been served every batch before ``k``."""
        was = self.next[rank]
        if k <= was:
            return
        self.next[rank] = k
        ranks_at = self._ranks_at
        ranks_at[k] = ranks_at.get(k, 0) + 1
        left = ranks_at[was] - 1
        if left:
            ranks_at[was] = left
            return
        del ranks_at[was]
        if was == self.oldest:
            self.oldest = min(ranks_at)  # few keys: ranks train in step, a chunk or two apart
