"""`ParquetRowGroups`: a Parquet train source that a resumed epoch enters at its position, unread before it.

Parquet footers carry each row group's row count, so the global order can be defined over row
groups (files in the given order, row groups in file order; with a seed, the row groups permuted
by ``(seed, epoch)``) and a position maps to a row group without reading data. `EpochFeeder` uses
a source with a ``stream`` method instead of running a Ray Dataset: the stream starts at the row
group holding the position (or, with the row shuffle, at the start of the shuffle window holding
it). Files and row groups wholly before the position are never opened by a read task; footers are
read once, where the source is built.

Sources: a list of Parquet file paths (in training order), or a folder or glob, local or a URI
(``"s3://bucket/tokens/"``, ``"gs://b/t/*.parquet"``): each expands to its ``.parquet`` files in
sorted order (`list_parquet`). `as_seekable` turns a ``ray.data.read_parquet(...)`` with nothing
after it but a column selection into the same source (detected through `_compat.parquet_read_of`).

Reads (`_read_units`): one Ray task reads consecutive row groups of the order until about
``read_bytes`` (16 MiB; each file opened once per task) and returns them as one block; each row
group is a slice of it in the stream, so the feeder's order, windows and seek do not depend on
how row groups are grouped into reads. Reads run ahead of the feeder's pull by ``ahead_bytes``
(64 MiB, at least one read), and a read's row groups are handed on only once the read finished:
its block then has a node, where a rank on another node cuts its rows (`block_fetch`).

`RayTrainer(datasets={"train": ParquetRowGroups(paths)})` runs it through the normal path: the
driver counts the epoch from the footers (`ParquetRowGroups.count`), the group's `EpochFeeder`
streams it, and a group started from a mid-epoch checkpoint (a restart, a resize, a run continued
by name) enters the epoch at its position. `is_seekable` is the one test for such a source
(`RunSpec.check_datasets` and the feeder use it); eval sets stay Ray Datasets.

The row-count-changing case (a ``map_batches`` that filters or packs) cannot seek this way: its
rows are known only by running it; see README ("The data path at scale").
"""

from __future__ import annotations

import fnmatch
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from raytrain_events.ray import _compat

__all__ = ["ParquetRowGroups", "is_seekable", "as_seekable", "list_parquet", "READ_BYTES", "AHEAD_BYTES"]

READ_BYTES = 16 << 20  # bytes (uncompressed, from the footers) per read task
AHEAD_BYTES = 64 << 20  # bytes of reads in flight ahead of the feeder's pull (at least one read)
_UNITS_PER_READ = 1024  # at most this many row groups per read task
_FOOTER_THREADS = 16  # footers read at once where the source is built (one GET each on an object store)
_GLOB = "*?["
logger = logging.getLogger(__name__)


def is_seekable(source: Any) -> bool:
    """Whether ``source`` is a seekable train source (rows known without reading them: ``count`` and
    ``stream``, as `ParquetRowGroups`) rather than a Ray Dataset, which a resume streams from row 0."""
    return callable(getattr(source, "stream", None)) and callable(getattr(source, "count", None))


def as_seekable(dataset: Any) -> Any:
    """``dataset`` as a seekable source when it can be one, else ``dataset`` itself (said once in the log).

    A ``ray.data.read_parquet(paths)``, optionally followed by column selections only, becomes
    ``ParquetRowGroups(paths, filesystem=<the read's>, columns=<the selection>)``: a resume then
    enters the epoch at its position. Anything else (a map, filter, limit, union...) keeps the
    re-streamed order: a resume runs the pipeline from row 0 and passes over the rows before it.
    """
    if is_seekable(dataset):
        return dataset

    read = _compat.parquet_read_of(dataset)
    if read is not None:
        paths, filesystem, columns = read
        source = ParquetRowGroups(paths, filesystem=filesystem, columns=columns)
        if any("=" in part for path in source.paths for part in path.split("/")[:-1]):
            logger.warning(
                "The train set (ray.data.read_parquet) has key=value folders, whose values Ray Data adds as "
                "columns: it is re-streamed on a resume. Pass ParquetRowGroups(paths) to seek without them."
            )
            return dataset
        logger.info(
            "The train set (ray.data.read_parquet of %d file(s)) is read by row group: a resume enters the "
            "epoch at its position and reads nothing before it.",
            len(source.paths),
        )
        return source
    logger.warning(
        "The train set is a Ray Dataset that is not a bare read_parquet (it has transforms after the read, or "
        "another source): a resume re-streams it from the epoch's first row and passes over the rows before "
        "its position. For a seekable train set pass ray.data.read_parquet(paths) with no transforms, or "
        "ParquetRowGroups(paths) over pre-processed Parquet."
    )
    return dataset


def list_parquet(
    paths: Union[str, Sequence[str]], filesystem: Any = None, storage_options: Optional[Dict[str, Any]] = None
) -> Tuple[List[str], Any]:
    """``(files, pyarrow filesystem or None)``: each of ``paths`` in the given order, a folder or glob
    expanded to its ``.parquet`` files (recursively, names starting with ``_`` or ``.`` left out) in
    sorted order. A URI (``s3://...``) without ``filesystem`` is opened through fsspec with
    ``storage_options`` (`raytrain_events.storage.fs.resolve`)."""
    from pyarrow import fs as pafs

    if isinstance(paths, bytes):
        raise TypeError(f"ParquetRowGroups takes a path, folder or URI as str, or a list of them; got {paths!r}.")
    given = [paths] if isinstance(paths, str) else [str(p) for p in paths]
    if not given:
        raise ValueError("ParquetRowGroups needs at least one Parquet file, folder or glob.")
    if filesystem is None and any("://" in p and not p.startswith("file://") for p in given):
        # why here: defers fsspec until this runs
        from raytrain_events.storage.fs import resolve

        fs, _ = resolve(given[0], storage_options)
        given = [resolve(p, storage_options)[1] for p in given]
        filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    given = [p[len("file://") :] if p.startswith("file://") else p for p in given]
    lister = filesystem if filesystem is not None else pafs.LocalFileSystem()
    files: List[str] = []
    for path in given:
        found = _expand(lister, path)
        if not found:
            raise FileNotFoundError(
                f"ParquetRowGroups found no Parquet files at {path!r} (a file, a folder of .parquet files or a "
                "glob such as 'bucket/tokens/*.parquet'). Check the path; for an object store pass a URI "
                "('s3://bucket/prefix/') with storage_options, or a pyarrow filesystem."
            )
        files += found
    return files, filesystem


def _expand(fs: Any, path: str) -> List[str]:
    from pyarrow import fs as pafs

    def parquet(info: Any) -> bool:
        name = info.base_name
        return info.type == pafs.FileType.File and name.endswith(".parquet") and not name.startswith(("_", "."))

    cut = min((path.index(c) for c in _GLOB if c in path), default=-1)
    if cut >= 0:  # a glob: list below its fixed prefix, match the whole pattern
        base = path[:cut].rsplit("/", 1)[0] if "/" in path[:cut] else ""
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        pattern = path.rstrip("/")
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern))
    info = fs.get_file_info(path.rstrip("/") or path)
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True))
        return sorted(i.path for i in infos if parquet(i))
    return [path] if info.type == pafs.FileType.File else []


def _read_units(paths: List[str], units: List[Tuple[int, int]], filesystem: Any, columns: Optional[List[str]]) -> Any:
    """One block: row groups ``units`` (file number, row group) in order, each file opened once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    i = 0
    while i < len(units):
        j = i
        while j < len(units) and units[j][0] == units[i][0]:
            j += 1
        path = paths[units[i][0]]
        with filesystem.open_input_file(path) if filesystem is not None else open(path, "rb") as f:
            file = pq.ParquetFile(f, pre_buffer=True)
            tables += [file.read_row_group(group, columns=columns) for _, group in units[i:j]]
        i = j
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables).combine_chunks()


def stream_entry(unit_rows: Sequence[int], row: int, window_rows: int = 0) -> Tuple[int, int, int]:
    """Where a stream that must reach global row ``row`` enters an epoch of units of ``unit_rows`` rows
    (row groups, pack windows), in their order: ``(the unit to start at, its first row, shuffle windows
    before it)``. With ``window_rows`` it enters at the shuffle window holding ``row`` (windows are
    consecutive units until one holds ``window_rows`` rows, as the feeder cuts them). Used by every
    seekable source of this package (`ParquetRowGroups`, `PackedTokens`)."""
    start = first = windows = filled = at = 0
    for j, rows in enumerate(unit_rows):
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
    return start, first, windows


class ParquetRowGroups:
    """Parquet files as a seekable train source (see module doc).

    ``paths``: a file, folder, glob or URI, or a list of them (in training order; a folder's files
    in sorted order). ``filesystem``: a pyarrow filesystem for them (else local, or fsspec for a URI
    with ``storage_options``). ``columns``: only these columns are read. ``read_bytes``: bytes per
    read task; ``ahead_bytes``: bytes read ahead of the feeder (see module doc).
    """

    def __init__(  # noqa: PLR0913 (the paths, then keyword-only: each a documented read option)
        self,
        paths: Union[str, Sequence[str]],
        *,
        filesystem: Any = None,
        columns: Optional[List[str]] = None,
        storage_options: Optional[Dict[str, Any]] = None,
        read_bytes: int = READ_BYTES,
        ahead_bytes: int = AHEAD_BYTES,
    ) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for name, value in (("read_bytes", read_bytes), ("ahead_bytes", ahead_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParquetRowGroups({name}={value!r}): give a number of bytes >= 1, e.g. 16 << 20.")
        self.paths, self.filesystem = list_parquet(paths, filesystem, storage_options)
        self.columns = None if columns is None else list(columns)
        self.read_bytes, self.ahead_bytes = read_bytes, ahead_bytes

        def footer(path: str) -> Any:
            if self.filesystem is None:
                return pq.ParquetFile(path).metadata
            with self.filesystem.open_input_file(path) as f:
                return pq.ParquetFile(f).metadata

        with ThreadPoolExecutor(min(_FOOTER_THREADS, len(self.paths))) as pool:
            metas = list(pool.map(footer, self.paths))  # in the paths' order
        self.units: List[Tuple[int, int, int]] = []  # (file number, row group, rows)
        self.sizes: Dict[Tuple[int, int], int] = {}  # (file number, row group) -> bytes read (uncompressed)
        for i, meta in enumerate(metas):
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                self.units.append((i, g, group.num_rows))
                self.sizes[(i, g)] = _group_bytes(group, self.columns)
        schema = metas[0].schema.to_arrow_schema()  # the first file's (a mixture compares its sources' schemas)
        missing = [c for c in self.columns or () if c not in schema.names]
        if missing:
            raise ValueError(
                f"ParquetRowGroups(columns={self.columns!r}) names {missing}, which {self.paths[0]!r} does not have; "
                f"its columns are {schema.names}. Fix: columns= of those names, or None for every column."
            )
        self.schema = (  # the file's key-value metadata kept (token files say their layout there: refuse_token_rows)
            schema
            if columns is None
            else pa.schema([schema.field(c) for c in columns if c in schema.names], metadata=schema.metadata)
        )
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

    def stream(
        self, seed: Optional[int], epoch: int, row: int, window_rows: int = 0, global_batch: Optional[int] = None
    ) -> Tuple[Iterator[Any], int, int]:
        """``(bundles from the row group holding ``row``, that group's first global row, windows before it)``.

        With ``window_rows`` the stream starts at the shuffle window holding ``row`` (windows are
        consecutive row groups until one holds ``window_rows`` rows, as the feeder cuts them).
        ``global_batch`` (the feeder's, given to every seekable source) does not change this order.
        """
        del global_batch
        units = self.order(seed, epoch)
        start, first, windows = stream_entry([rows for _, _, rows in units], row, window_rows)
        return self._bundles(units[start:]), first, windows

    def reads(self, units: Sequence[Tuple[int, int, int]]) -> List[List[Tuple[int, int, int]]]:
        """``units`` grouped into reads: consecutive row groups until about `read_bytes` (a pure function)."""
        out: List[List[Tuple[int, int, int]]] = []
        current: List[Tuple[int, int, int]] = []
        size = 0
        for unit in units:
            current.append(unit)
            size += self.sizes[(unit[0], unit[1])]
            if size >= self.read_bytes or len(current) >= _UNITS_PER_READ:
                out.append(current)
                current, size = [], 0
        return out + ([current] if current else [])

    def _bundles(self, units: List[Tuple[int, int, int]]) -> Iterator[Any]:
        import ray

        read = ray.remote(_read_units).options(num_cpus=0.25)
        todo = iter(self.reads(units))
        pending: deque = deque()  # (block ref, its row groups, bytes)
        in_flight = 0
        while True:
            while not pending or in_flight < self.ahead_bytes:
                group = next(todo, None)
                if group is None:
                    break
                size = sum(self.sizes[(f, g)] for f, g, _ in group)
                ref = read.remote(self.paths, [(f, g) for f, g, _ in group], self.filesystem, self.columns)
                pending.append((ref, group, size))
                in_flight += size
            if not pending:
                return
            ref, group, size = pending.popleft()
            ray.wait([ref], fetch_local=False)  # handed on once read: the block then has a node to cut on
            in_flight -= size
            offset = 0
            for _, _, rows in group:
                meta = SimpleNamespace(num_rows=rows)
                yield SimpleNamespace(
                    blocks=[(ref, meta)], slices=[SimpleNamespace(start_offset=offset, num_rows=rows)]
                )
                offset += rows


def _group_bytes(group: Any, columns: Optional[List[str]]) -> int:
    """A row group's uncompressed bytes, of ``columns`` only when given (from its footer)."""
    if columns is None:
        return int(group.total_byte_size)
    wanted = set(columns)
    return sum(
        int(group.column(c).total_uncompressed_size)
        for c in range(group.num_columns)
        if group.column(c).path_in_schema.split(".")[0] in wanted
    )
