"""`ParquetRowGroups`: a Parquet train source that a resumed epoch enters at its position, unread before it.

Parquet footers carry each row group's row count, so the global order can be defined over row
groups (files in the given order, row groups in file order; with a seed, the row groups permuted
by ``(seed, epoch)``) and a position maps to a row group without reading data. `EpochFeeder` uses
a source with a ``stream`` method instead of running a Ray Dataset: the stream starts at the row
group holding the position (or, with the row shuffle, at the start of the shuffle window holding
it), and each block is one row group read by a Ray task (``_read_row_group``), a few tasks ahead
of the feeder's pull. Files and row groups wholly before the position are never opened by a read
task; footers are read once, where the source is built.

`RayTrainer(datasets={"train": ParquetRowGroups(paths)})` runs it through the normal path: the
driver counts the epoch from the footers (`ParquetRowGroups.count`), the group's `EpochFeeder`
streams it, and a group started from a mid-epoch checkpoint (a restart, a resize, a run continued
by name) enters the epoch at its position. `is_seekable` is the one test for such a source
(`RunSpec.check_datasets` and the feeder use it); eval sets stay Ray Datasets.

The row-count-changing case (a ``map_batches`` that filters or packs) cannot seek this way: its
rows are known only by running it; see README ("The data path at scale").
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ParquetRowGroups", "is_seekable"]

_READS_AHEAD = 4  # row-group read tasks in flight ahead of the feeder's pull
_FOOTER_THREADS = 16  # footers read at once where the source is built (one GET each on an object store)


def is_seekable(source: Any) -> bool:
    """Whether ``source`` is a seekable train source (rows known without reading them: ``count`` and
    ``stream``, as `ParquetRowGroups`) rather than a Ray Dataset, which a resume streams from row 0."""
    return callable(getattr(source, "stream", None)) and callable(getattr(source, "count", None))


def _read_row_group(path: str, group: int, filesystem: Any, columns: Optional[List[str]]) -> Any:
    import pyarrow.parquet as pq

    with filesystem.open_input_file(path) if filesystem is not None else open(path, "rb") as f:
        return pq.ParquetFile(f).read_row_group(group, columns=columns)


class ParquetRowGroups:
    """Parquet files as a seekable train source (see module doc); ``filesystem``: a pyarrow one."""

    def __init__(self, paths: Sequence[str], *, filesystem: Any = None, columns: Optional[List[str]] = None) -> None:
        import pyarrow.parquet as pq

        if isinstance(paths, (str, bytes)):
            raise TypeError(
                f"ParquetRowGroups takes a list of Parquet file paths in training order, got the string {paths!r}: "
                "pass [path] for one file, or sorted(glob.glob(folder + '/*.parquet')) for a folder's files."
            )
        if not paths:
            raise ValueError("ParquetRowGroups needs at least one Parquet file path.")
        self.paths = list(paths)
        self.filesystem = filesystem
        self.columns = columns

        def footer(path: str) -> Any:
            if filesystem is None:
                return pq.ParquetFile(path).metadata
            with filesystem.open_input_file(path) as f:
                return pq.ParquetFile(f).metadata

        with ThreadPoolExecutor(min(_FOOTER_THREADS, len(self.paths))) as pool:
            metas = list(pool.map(footer, self.paths))  # in the paths' order
        self.units: List[Tuple[int, int, int]] = []  # (file number, row group, rows)
        for i, meta in enumerate(metas):
            self.units += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        if not self.count():
            raise ValueError(f"The Parquet files {self.paths[:3]}{'...' if len(self.paths) > 3 else ''} hold no rows.")

    def count(self) -> int:
        """Rows in an epoch (from the footers)."""
        return sum(rows for _, _, rows in self.units)

    def order(self, seed: Optional[int], epoch: int) -> List[Tuple[int, int, int]]:
        """The epoch's row groups in order: as listed, or permuted by ``(seed, epoch)``."""
        if seed is None:
            return list(self.units)
        perm = np.random.default_rng([seed, epoch, 1]).permutation(len(self.units))
        return [self.units[i] for i in perm]

    def stream(self, seed: Optional[int], epoch: int, row: int, window_rows: int = 0) -> Tuple[Iterator[Any], int, int]:
        """``(bundles from the row group holding ``row``, that group's first global row, windows before it)``.

        With ``window_rows`` the stream starts at the shuffle window holding ``row`` (windows are
        consecutive row groups until one holds ``window_rows`` rows, as the feeder cuts them).
        """
        units = self.order(seed, epoch)
        start, first, windows, filled = 0, 0, 0, 0
        at = 0
        for j, (_, _, rows) in enumerate(units):
            if window_rows:
                filled += rows
                if filled >= window_rows:  # a window ends after unit j
                    if at + filled > row:
                        break
                    at += filled
                    filled, windows, start, first = 0, windows + 1, j + 1, at
            else:
                if at + rows > row:
                    start, first = j, at
                    break
                at += rows
                start, first = j + 1, at
        return self._bundles(units[start:]), first, windows

    def _bundles(self, units: List[Tuple[int, int, int]]) -> Iterator[Any]:
        import ray

        read = ray.remote(_read_row_group).options(num_cpus=0.25)
        pending: deque = deque()
        todo = iter(units)
        for _ in range(_READS_AHEAD):
            unit = next(todo, None)
            if unit is not None:
                pending.append((read.remote(self.paths[unit[0]], unit[1], self.filesystem, self.columns), unit[2]))
        while pending:
            ref, rows = pending.popleft()
            unit = next(todo, None)
            if unit is not None:
                pending.append((read.remote(self.paths[unit[0]], unit[1], self.filesystem, self.columns), unit[2]))
            yield SimpleNamespace(blocks=[(ref, SimpleNamespace(num_rows=rows))], slices=None)
