"""A resume at 50% of a multi-file Parquet epoch reads nothing before its position.

`ParquetRowGroups` over 20 files (2 row groups of 50 rows each) through a pyarrow filesystem that
logs every file a read task opens (a picklable `FileSystemHandler` appending to a log file). The
loaders of 2 ranks, resumed at row 1,000 (file 10's first row) and at row 1,025 (inside file 10's
first row group), train exactly the rows from the position, no read task opens files 0-9, and
the feeder holds a bounded number of blocks. With the row shuffle, a resume continues the same
shuffled order.
"""

from __future__ import annotations

import os
import sys
from typing import List

import pytest
from pyarrow import fs as pafs
from ray import cloudpickle as ray_cloudpickle

from raytrain_events.ray.feeder import FEEDER_OPTIONS, EpochFeeder
from raytrain_events.ray.parquet_seek import ParquetRowGroups

FILES, FILE_ROWS, GROUP_ROWS = 20, 100, 50
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the counting handler, to read tasks


class CountingHandler(pafs.FileSystemHandler):
    """The local filesystem; each ``open_input_file`` appends the path to ``log`` (any process)."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.local = pafs.LocalFileSystem()

    def __eq__(self, other):
        return isinstance(other, CountingHandler) and other.log == self.log

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "counting"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def open_input_file(self, path):
        with open(self.log, "a") as f:
            f.write(path + "\n")
        return self.local.open_input_file(path)

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def _refuse(self, *args, **kwargs):
        raise OSError("read-only test filesystem")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _refuse
    move = copy_file = open_output_stream = open_append_stream = _refuse


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory) -> List[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("seek")
    paths = []
    for i in range(FILES):
        ids = list(range(i * FILE_ROWS, (i + 1) * FILE_ROWS))
        path = str(folder / f"part-{i:02d}.parquet")
        pq.write_table(pa.table({"id": ids, "tokens": [7] * FILE_ROWS}), path, row_group_size=GROUP_ROWS)
        paths.append(path)
    return paths


def _epoch(ray, source, world: int, position: int, seed=None, shuffle_rows=None, held: list = None):
    from raytrain_events.ray.data import GlobalOrderLoader, GlobalOrderShard

    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, world, 40)
    loaders = [
        GlobalOrderLoader(
            GlobalOrderShard(feeder, r, world, 40, source.count()),
            device="cpu",
            order_seed=seed,
            shuffle_rows=shuffle_rows,
            columns=["id"],
        )
        for r in range(world)
    ]
    for loader in loaders:
        loader.set_epoch(0)
        loader.set_position(position)
    rows: List[int] = []
    for per_rank in zip(*loaders, strict=True):
        rows += [row for batch in per_rank for row in batch["id"].tolist()]
        if held is not None:
            held.append(sum(ray.get(feeder.held_blocks.remote()).values()))
    return rows


@pytest.mark.ray
def test_a_resume_at_half_opens_no_file_before_its_position(ray_cluster, parquet_files, tmp_path) -> None:
    ray = ray_cluster
    log = str(tmp_path / "opened.log")
    source = ParquetRowGroups(parquet_files, filesystem=pafs.PyFileSystem(CountingHandler(log)))
    os.remove(log)  # the footers, read once where the source is built
    total = FILES * FILE_ROWS
    for position in (total // 2, total // 2 + 25):
        held: List[int] = []
        assert _epoch(ray, source, 2, position, held=held) == list(range(position, total))
        with open(log) as f:
            opened = {os.path.basename(line.strip()) for line in f}
        os.remove(log)
        assert not {f"part-{i:02d}.parquet" for i in range(FILES // 2)} & opened, sorted(opened)
        assert f"part-{FILES // 2:02d}.parquet" in opened
        # Blocks (row groups of 50 rows) held: the batches in flight + the pull's look-ahead.
        assert max(held) <= 12, held


@pytest.mark.ray
def test_a_shuffled_seekable_epoch_resumes_in_the_same_order(ray_cluster, parquet_files) -> None:
    ray = ray_cluster
    source = ParquetRowGroups(parquet_files)
    total = FILES * FILE_ROWS
    full = _epoch(ray, source, 2, 0, seed=5, shuffle_rows=120)
    assert sorted(full) == list(range(total)) and full != list(range(total))
    assert _epoch(ray, source, 3, 1_000, seed=5, shuffle_rows=120) == full[1_000:]
