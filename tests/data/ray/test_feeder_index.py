"""The feeder's buffer at scale, without Ray: `BlockIndex` lookups and trims, `RankCursor`, and
`EpochFeeder` driven in-process over a stand-in dataset (fake block refs with row counts).

What is checked: every row of an epoch served once to the rank that owns it, whatever the block
sizes and the order ranks call in; the buffer bounded (blocks every rank is past are dropped, blocks
before a resume's position never held); and a call served while the streaming execution is blocked.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raytrain_events.data.ray.feeder import EpochFeeder, batches_in_epoch, rank_rows
from raytrain_events.data.ray.row_index import BlockIndex, RankCursor
from raytrain_events.data.ray.slices import Take


class FakeDataset:
    """What `EpochFeeder` uses of a Ray Dataset; block ``i`` is the ref ``i``, rows listed in ``sizes``.

    ``gate``: the stream blocks before block ``gate_at`` until the event is set (a slow execution).
    """

    def __init__(self, sizes: List[int], gate: Optional[threading.Event] = None, gate_at: int = 0) -> None:
        self.sizes = sizes
        self.gate, self.gate_at = gate, gate_at
        self.context = SimpleNamespace(execution_options=SimpleNamespace(preserve_order=False))
        self.pulled = 0
        self.order = list(range(len(sizes)))

    def randomize_block_order(self, seed: int) -> FakeDataset:
        """The same blocks (same refs) in an order drawn from ``seed``, as Ray Data's."""
        import random

        permuted = FakeDataset(self.sizes, self.gate, self.gate_at)
        random.Random(seed).shuffle(permuted.order)
        return permuted

    def iter_internal_ref_bundles(self) -> Iterator[Any]:
        for n, i in enumerate(self.order):
            if self.gate is not None and n == self.gate_at:
                self.gate.wait()
            self.pulled = n + 1
            yield SimpleNamespace(blocks=[(i, SimpleNamespace(num_rows=self.sizes[i]))], slices=None)


def _rows(slices, sizes: List[int]) -> List[int]:
    """Global row ids of block slices (block i's rows are ``sum(sizes[:i]) + j``)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out: List[int] = []
    for piece in slices:
        if isinstance(piece, Take):  # row rows[j] of block refs[which[j]]
            out += [starts[piece.refs[w]] + int(r) for w, r in zip(piece.which, piece.rows)]
        else:
            out += [starts[piece.ref] + j for j in range(piece.lo, piece.hi)]
    return out


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=40), data=st.data())
def test_block_index_slices_are_exactly_the_rows(sizes: List[int], data) -> None:
    index = BlockIndex()
    for i, size in enumerate(sizes):
        index.append(i, 0, size) if size else index.skip(0)
    total = sum(sizes)
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    assert _rows(index.slices(a, b), sizes) == list(range(a, b))
    index.trim(a)  # blocks wholly before `a` go; the rows from `a` on are still there
    assert _rows(index.slices(a, b), sizes) == list(range(a, b))
    if index.first_row() > 0 and index.first_row() < total:
        with pytest.raises(LookupError, match="dropped"):
            index.slices(index.first_row() - 1, total)


@given(moves=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=200))
def test_rank_cursor_keeps_the_oldest(moves) -> None:
    cursor = RankCursor(8)
    for rank, step in moves:
        cursor.advance(rank, cursor.next[rank] + step)
        assert cursor.oldest == min(cursor.next)


def _blocks_over(sizes: List[int], rows: int) -> int:
    """The most blocks that ``rows`` consecutive rows can touch."""
    most = 0
    for i in range(len(sizes)):
        j, covered = i, 0
        while j < len(sizes) and covered < rows:
            covered += sizes[j]
            j += 1
        most = max(most, j - i + 1)
    return most


def _serve_epoch(feeder: EpochFeeder, world: int, position: int, chunk: int, order: List[int]) -> List[List[int]]:
    """Each rank's rows, ranks calling in ``order`` (a permutation repeated), chunks of ``chunk`` batches."""
    sizes = feeder.dataset.sizes
    feeder.start_epoch(0, position, None, 0)
    rows: List[List[int]] = [[] for _ in range(world)]
    nxt, finished = [0] * world, [False] * world
    held = 0
    while not all(finished):
        for rank in order:
            if finished[rank]:
                continue
            served = feeder.batches(0, position, rank, nxt[rank], chunk)
            nxt[rank] += chunk
            for slices in served:
                if slices is None:
                    finished[rank] = True
                    break
                rows[rank].append(_rows(slices, sizes))
            held = max(held, feeder.held_blocks()[f"0@{position}"])
    feeder.epochs[(0, position)].stop()
    return rows, held


@pytest.mark.parametrize("world,chunk", [(1, 1), (3, 1), (5, 4), (16, 16)])
def test_every_row_once_and_the_buffer_bounded(world: int, chunk: int) -> None:
    sizes = [(i * 7) % 23 + 1 for i in range(300)]  # blocks of 1-23 rows
    total, global_batch = sum(sizes), 40
    for position in (0, total // 2):
        feeder = EpochFeeder(FakeDataset(sizes), world, global_batch)
        order = list(range(world))[::-1]
        rows, held = _serve_epoch(feeder, world, position, chunk, order)
        batches = batches_in_epoch(total, global_batch, world, position)
        assert all(len(r) == batches for r in rows)
        flat = [row for k in range(batches) for r in range(world) for row in rows[r][k]]
        assert flat == list(range(position, total))  # every row once, in order, from the position
        for k in range(batches - 1):
            start = position + k * global_batch
            assert [(r[k][0], r[k][-1] + 1) for r in rows] == [
                rank_rows(start, start + global_batch, rank, world) for rank in range(world)
            ]
        # Held at most: blocks over the chunk in flight + the pull's look-ahead (2 batches) + one batch.
        assert held <= _blocks_over(sizes, (chunk + 4) * global_batch), held


def test_calls_are_served_while_the_stream_is_blocked() -> None:
    gate = threading.Event()
    feeder = EpochFeeder(FakeDataset([10] * 100, gate=gate, gate_at=20), 2, 10)
    try:
        feeder.start_epoch(0, 0, None, 0)
        # 200 rows are there; the stream then blocks. Batches 0-9 are served, though the pull is stuck.
        out = [feeder.batches(0, 0, rank, 0, 10) for rank in range(2)]
        assert all(len(b) == 10 and None not in b for b in out)
        done: List[Any] = []
        later = threading.Thread(target=lambda: done.append(feeder.batches(0, 0, 0, 25, 1)), daemon=True)
        later.start()
        later.join(0.3)
        assert not done  # batch 25 waits for the stream...
        gate.set()
        later.join(10)
        assert done and done[0][0] is not None  # ...and comes once it moves on
    finally:
        gate.set()
        feeder.epochs[(0, 0)].stop()


def test_a_failing_stream_is_an_error_in_the_call() -> None:
    class Broken(FakeDataset):
        def iter_internal_ref_bundles(self):
            yield SimpleNamespace(blocks=[(0, SimpleNamespace(num_rows=5))], slices=None)
            raise OSError("disk gone")

    feeder = EpochFeeder(Broken([5]), 1, 10)
    feeder.start_epoch(0, 0, None, 0)
    with pytest.raises(RuntimeError, match="streaming execution failed.*disk gone"):
        feeder.batches(0, 0, 0, 0, 1)


def test_slices_are_typed_values_that_say_which_rows_of_which_blocks_they_read() -> None:
    from raytrain_events.data.ray.loader import _merged
    from raytrain_events.data.ray.shuffle import WindowIndex
    from raytrain_events.data.ray.slices import RowRange

    index = BlockIndex()
    index.append("a", 2, 5)  # global rows 0..4 are rows 2..6 of block a
    index.append("b", 0, 4)  # global rows 5..8 are rows 0..3 of block b
    assert index.slices(3, 8) == [RowRange("a", 5, 7), RowRange("b", 0, 3)]
    assert all(isinstance(piece, RowRange) for piece in index.slices(0, 9))
    assert [(ref, rows.tolist()) for ref, rows in RowRange("a", 5, 7).block_rows()] == [("a", [5, 6])]
    # Row groups of one read are joined; a range of another block, or a take, is not.
    assert _merged([RowRange("a", 5, 7), RowRange("a", 7, 9), RowRange("b", 9, 10)]) == [
        RowRange("a", 5, 9),
        RowRange("b", 9, 10),
    ]
    take = Take(["b", "c"], np.array([1, 0, 1]), np.array([7, 30, 2]))
    assert take.blocks() == ("b", "c") and RowRange("c", 0, 7).then(take) is None and take.then(take) is None
    assert [(ref, rows.tolist()) for ref, rows in take.block_rows()] == [("b", [30]), ("c", [7, 2])]
    windows = WindowIndex(seed=0, epoch=0)
    windows.append_window([("a", 0, 3), ("b", 0, 2)])
    (shuffled,) = windows.slices(0, 5)
    assert isinstance(shuffled, Take) and set(shuffled.blocks()) == {"a", "b"}
    assert {ref: sorted(rows.tolist()) for ref, rows in shuffled.block_rows()} == {"a": [0, 1, 2], "b": [0, 1]}
