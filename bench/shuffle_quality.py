"""Shuffle quality of the global order: how mixed are the rows a step trains?

A dataset written in document order (Parquet from a tokenizer) keeps neighbouring rows together:
training them in one step is what a shuffle is for. Over an epoch of ``--rows`` rows in blocks of
``--block-rows`` (each block one file's worth of neighbouring rows), global batches of ``--batch``:

- ``same-block share``: the mean fraction of a global batch that comes from its most common
  source block (1.0: the batch is one block; ideal ~ batch/rows-per-block... ~1/blocks);
- ``blocks per batch``: distinct source blocks in a global batch (more is better);
- ``neighbour gap``: the median distance, in source rows, between consecutive trained rows
  (1: no shuffle; a full random permutation: ~rows/3 on average, rows*0.29 median).

Orders compared: no shuffle; a block-only permutation (what the feeder did before: Ray Data's
``randomize_block_order``); ours (block permutation + rows permuted within windows of
``--window`` rows, the REAL feeder in-process over fake blocks); a simulated local shuffle buffer
of ``--window`` rows (the algorithm behind Ray Data's ``local_shuffle_buffer_size``: fill a
buffer, emit a random row, refill); a full random permutation (what Ray Data's
``random_shuffle`` produces, at the cost of an all-to-all exchange of the whole dataset).

Usage::

    python bench/shuffle_quality.py
    python bench/shuffle_quality.py --rows 262144 --block-rows 4096 --batch 1024 --window 32768
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Any, Iterator, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from raytrain_events.data.order import TrainOrder  # noqa: E402
from raytrain_events.data.ray.feeder import EpochFeeder  # noqa: E402
from raytrain_events.data.ray.slices import Take  # noqa: E402


class _Blocks:
    """A stand-in dataset: blocks ``0..n-1`` of ``rows`` rows each (the refs are the block numbers)."""

    def __init__(self, n: int, rows: int, order: List[int]) -> None:
        self.n, self.rows, self.order = n, rows, order
        self.context = SimpleNamespace(execution_options=SimpleNamespace(preserve_order=False))

    def randomize_block_order(self, seed: int) -> Any:
        return _Blocks(self.n, self.rows, list(np.random.default_rng(seed).permutation(self.n)))

    def iter_internal_ref_bundles(self) -> Iterator[Any]:
        for i in self.order:
            yield SimpleNamespace(blocks=[(int(i), SimpleNamespace(num_rows=self.rows))], slices=None)


def _ours(blocks: int, block_rows: int, batch: int, window: int, seed: int) -> np.ndarray:
    feeder = EpochFeeder(_Blocks(blocks, block_rows, list(range(blocks))), 1, batch)
    feeder.start_epoch(0, 0, TrainOrder(seed, window), 0)
    out: List[np.ndarray] = []
    k = 0
    while True:
        slices = feeder.batches(0, 0, 0, k, 16)
        for piece_list in slices:
            if piece_list is None:
                feeder.epochs[(0, 0)].stop()
                return np.concatenate(out)
            for piece in piece_list:
                if isinstance(piece, Take):
                    out.append(np.array(piece.refs)[piece.which] * block_rows + piece.rows)
                else:
                    out.append(piece.ref * block_rows + np.arange(piece.lo, piece.hi))
        k += 16


def _local_buffer(order: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    buffer: List[int] = []
    out: List[int] = []
    for row in order:
        buffer.append(int(row))
        if len(buffer) >= size:
            j = int(rng.integers(len(buffer)))
            buffer[j], buffer[-1] = buffer[-1], buffer[j]
            out.append(buffer.pop())
    rng.shuffle(buffer)
    return np.array(out + buffer)


def _quality(order: np.ndarray, block_rows: int, batch: int) -> tuple:
    blocks = order // block_rows
    shares, distinct = [], []
    for start in range(0, len(order) - batch + 1, batch):
        _, counts = np.unique(blocks[start : start + batch], return_counts=True)
        shares.append(counts.max() / batch)
        distinct.append(len(counts))
    gap = np.median(np.abs(np.diff(order)))
    return float(np.mean(shares)), float(np.mean(distinct)), float(gap)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--block-rows", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--window", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    blocks = args.rows // args.block_rows
    rows = blocks * args.block_rows
    rng = np.random.default_rng(args.seed)
    block_perm = np.random.default_rng(args.seed).permutation(blocks)
    block_only = (block_perm[:, None] * args.block_rows + np.arange(args.block_rows)).reshape(-1)
    orders = {
        "no shuffle": np.arange(rows),
        "block permutation only": block_only,
        f"ours: blocks + rows in {args.window}-row windows": _ours(
            blocks, args.block_rows, args.batch, args.window, args.seed
        ),
        f"local shuffle buffer of {args.window} rows (sim.)": _local_buffer(block_only, args.window, rng),
        "full random permutation (random_shuffle)": rng.permutation(rows),
    }
    print(f"{rows} rows, {blocks} blocks of {args.block_rows}, global batch {args.batch}")
    print(f"{'order':<52} {'same-block share':>16} {'blocks/batch':>13} {'neighbour gap':>14}")
    for name, order in orders.items():
        assert sorted(order.tolist()) == list(range(rows)), name
        share, distinct, gap = _quality(order, args.block_rows, args.batch)
        print(f"{name:<52} {share:>16.3f} {distinct:>13.1f} {gap:>14.0f}")


if __name__ == "__main__":
    main()
