"""A resume at 50% of a multi-file Parquet epoch reads nothing before its position.

Through `RayTrainer` (``datasets={"train": ParquetRowGroups(paths)}``): a run stopped half-way
through its epoch and continued by name with another world size, its train set now given as
``ray.data.read_parquet(folder)`` (detected and given the same seek), opens no file wholly before
its position, holds a bounded number of blocks, and ends at the exact Timestamp with
every row trained once across both runs.

Directly through the loaders and the feeder:
`ParquetRowGroups` over 20 files (2 row groups of 50 rows each) through a pyarrow filesystem that
logs every file a read task opens (a picklable `FileSystemHandler` appending to a log file). The
loaders of 2 ranks, resumed at row 1,000 (file 10's first row) and at row 1,025 (inside file 10's
first row group), train exactly the rows from the position, no read task opens files 0-9, and
the feeder holds a bounded number of blocks. With the row shuffle, a resume continues the same
shuffled order. The same seek through a ``ray.data.read_parquet(folder)`` (detected: `as_seekable`)
and through a folder URI on S3 (the moto server); reads sized in bytes, each handed on once read;
token columns (a fixed-size list of int32, a binary of uint16) reach the loop as tensors without
Ray Data's per-row NumPy conversion.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from typing import List

import pytest
from pyarrow import fs as pafs
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
from raytrain_events.data.ray.parquet_seek import ParquetRowGroups, as_seekable
from tests import resume_helpers as h

FILES, FILE_ROWS, GROUP_ROWS = 20, 100, 50
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the counting handler, to read tasks
ray_cloudpickle.register_pickle_by_value(h)  # the row records, to the workers


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
            f.write(f"{path} {os.getpid()}\n")
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


def _epoch(
    ray,
    source,
    world: int,
    position: int,
    seed=None,
    shuffle_rows=None,
    held: list = None,
    batches=None,
    columns=("id",),
):
    from raytrain_events.data.order import TrainOrder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, world, 40)
    loaders = [
        GlobalOrderLoader(
            GlobalOrderShard(feeder, r, world, 40, source.count(), order=TrainOrder(seed, shuffle_rows)),
            device="cpu",
            columns=list(columns),  # only these reach the batch
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
        if batches is not None:
            batches += per_rank
    return rows


def _opened_files(log: str) -> set:
    with open(log) as f:
        return {os.path.basename(line.split()[0]) for line in f}


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
        opened = _opened_files(log)
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


@pytest.mark.ray
def test_a_bare_read_parquet_and_a_folder_uri_seek(ray_cluster, parquet_files, tmp_path, s3_server, caplog) -> None:
    import ray.data
    import s3fs

    ray = ray_cluster
    total, position = FILES * FILE_ROWS, 1_025
    folder = os.path.dirname(parquet_files[0])
    # read_parquet(folder) with nothing after it but a column selection: the same seek, its files in sorted order.
    log = str(tmp_path / "opened.log")
    read = ray.data.read_parquet(folder, filesystem=pafs.PyFileSystem(CountingHandler(log)))
    source = as_seekable(read.select_columns(["id", "tokens"]))
    assert isinstance(source, ParquetRowGroups) and source.paths == parquet_files and source.columns == ["id", "tokens"]
    os.remove(log)  # Ray's planning and the footers
    assert _epoch(ray, source, 2, position) == list(range(position, total))
    opened = _opened_files(log)
    assert not {f"part-{i:02d}.parquet" for i in range(FILES // 2)} & opened, sorted(opened)
    # Anything else keeps the re-streamed Ray Dataset, and says so.
    mapped = ray.data.read_parquet(folder).map_batches(lambda batch: batch)
    with caplog.at_level(logging.WARNING, logger="raytrain_events.data.ray.parquet_seek"):
        assert as_seekable(mapped) is mapped
    assert "a resume re-streams it from the epoch's first row" in caplog.text
    hive = tmp_path / "hive" / "lang=en"  # Ray Data adds a "lang" column from the folder: no seek without it
    hive.mkdir(parents=True)
    os.link(parquet_files[0], hive / "part-00.parquet")
    partitioned = ray.data.read_parquet(str(tmp_path / "hive"))
    assert as_seekable(partitioned) is partitioned
    # A folder URI on S3 (moto): listed in sorted order, entered at the position.
    options = s3_server["storage_options"]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    prefix = f"{s3_server['bucket']}/seek-tokens"
    for path in reversed(parquet_files):  # written out of order: the listing sorts
        fs.put(path, f"{prefix}/{os.path.basename(path)}")
    remote = ParquetRowGroups(f"s3://{prefix}/", storage_options=options)
    assert [os.path.basename(p) for p in remote.paths] == [os.path.basename(p) for p in parquet_files]
    assert _epoch(ray, remote, 3, position) == list(range(position, total))


@pytest.mark.ray
def test_reads_are_sized_in_bytes_and_handed_on_once_read(ray_cluster, parquet_files) -> None:
    ray = ray_cluster
    group_bytes = ParquetRowGroups(parquet_files).sizes[(0, 0)]
    source = ParquetRowGroups(parquet_files, read_bytes=5 * group_bytes - 1)
    reads = source.reads(source.units)
    assert [len(r) for r in reads] == [5] * 8  # 40 row groups, 5 per read (the 5th reaches read_bytes)
    bundles, first, _ = source.stream(None, 0, 1_025)
    assert first == 1_000
    refs = []
    for bundle in bundles:
        (ref, meta), (piece,) = bundle.blocks[0], bundle.slices
        assert ray.wait([ref], timeout=0)[0], "a row group was handed on before its read finished"
        refs.append((ref, piece.start_offset, meta.num_rows))
    assert len(refs) == 20 and len({ref for ref, _, _ in refs}) == 4  # 20 row groups from 4 reads
    assert [offset for _, offset, _ in refs[:5]] == [0, 50, 100, 150, 200]


@pytest.mark.ray
def test_token_columns_reach_the_loop_as_tensors_without_per_row_objects(ray_cluster, tmp_path, monkeypatch) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from ray.data.block import BlockAccessor

    ray = ray_cluster
    width, rows = 8, 150
    ids = np.arange(rows)
    tokens = (ids[:, None] * width + np.arange(width)).astype(np.int32)
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("tokens", pa.list_(pa.int32(), width)),
            pa.field("u16", pa.binary(), metadata={"dtype": "uint16"}),
        ]
    )
    table = pa.table(
        {
            "id": ids,
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), width),
            "u16": pa.array([row.astype(np.uint16).tobytes() for row in tokens], pa.binary()),
        },
        schema=schema,
    )
    folder = tmp_path / "tokens"
    folder.mkdir()
    for i in range(3):
        pq.write_table(table.slice(i * 50, 50), folder / f"t-{i}.parquet", row_group_size=15)

    def no_numpy_batches(*args, **kwargs):
        raise AssertionError("a batch went through Ray Data's NumPy batch format (per-row objects)")

    monkeypatch.setattr(BlockAccessor, "to_batch_format", no_numpy_batches)
    group_bytes = ParquetRowGroups(str(folder)).sizes[(0, 0)]
    source = ParquetRowGroups(str(folder), read_bytes=2 * group_bytes)  # 30 rows per read: batches span blocks
    batches: list = []
    assert _epoch(ray, source, 2, 20, batches=batches, columns=("id", "tokens", "u16")) == list(range(20, rows))
    for batch in batches:
        assert batch["tokens"].dtype == torch.int32 and batch["u16"].dtype == torch.uint16
        expected = torch.from_numpy(tokens[batch["id"].numpy()])
        assert torch.equal(batch["tokens"], expected) and torch.equal(batch["u16"].to(torch.int32), expected)


# The RayTrainer run: 40 files (39 of 40 rows, one of 43), row groups of 8 rows, global batches of 8:
# 1,603 rows = 200 batches + a tail of 3 rows (its own batch at 2 or 3 workers), 201 row groups.
RUN_FILE_ROWS = (40,) * 39 + (43,)
RUN_GROUP_ROWS, RUN_BATCH = 8, 8
RUN_ROWS, RUN_BATCHES = sum(RUN_FILE_ROWS), 201
STOP = 101  # global batches of the first run: row 808 = file 20's second row group (rows 808-815)


class HeldBlocks(Callback):
    """Rank 0 appends, after each batch, how many blocks the group's feeder holds (`held_blocks`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def batch_end(self, state, logger) -> None:
        if state.rank == 0:
            import ray

            held = ray.get(state.train_dataloader.shard.feeder.held_blocks.remote())
            with open(self.path, "a") as f:
                f.write(f"{sum(held.values())}\n")


def _opened(log: str) -> Counter:
    """Files opened by read tasks (not by this process, which reads the footers where the source is built)."""
    with open(log) as f:
        lines = [line.split() for line in f]
    return Counter(os.path.basename(path) for path, pid in lines if int(pid) != os.getpid())


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two Ray runs; minutes each on a loaded machine
def test_ray_trainer_resumed_at_half_an_epoch_reads_nothing_before_its_position(ray_cluster, tmp_path) -> None:
    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig

    data, records, logs = (str(tmp_path / name) for name in ("data", "records", "logs"))
    os.makedirs(records), os.makedirs(logs)
    tokens = h.write_parquet(data, RUN_FILE_ROWS, RUN_GROUP_ROWS)
    paths = [os.path.join(data, f"part-{i:02d}.parquet") for i in range(len(RUN_FILE_ROWS))]
    for i, path in enumerate(paths):  # names that sort in the ids' order, as a folder's files are listed
        os.rename(os.path.join(data, f"part-{i}.parquet"), path)
    checkpoint = CheckpointConfig(save_interval="20ba", keep=1, save_every_n_seconds=None, autoresume=True)
    results = []
    for attempt, (workers, duration) in enumerate(((2, f"{STOP}ba"), (3, "1ep"))):
        # A source per run, each logging the files its read tasks open (its footers were read here: not logged).
        log, held = os.path.join(logs, f"opened-{attempt}.log"), os.path.join(logs, f"held-{attempt}.log")
        counting = pafs.PyFileSystem(CountingHandler(log))
        if attempt == 0:
            source = ParquetRowGroups(paths, filesystem=counting)
        else:  # a bare read_parquet of the folder: RayTrainer detects it and seeks the same way
            import ray.data

            source = ray.data.read_parquet(data, filesystem=counting)
        os.remove(log)
        results.append(
            RayTrainer(
                model=h.make_model,
                optimizers=h.make_sgd,
                datasets={"train": source},
                batch_size=999,  # ignored: global_batch_size fixes the rows per step
                global_batch_size=RUN_BATCH,
                get_num_tokens_in_batch=h.count_tokens,
                max_duration=duration,
                num_workers=workers,
                storage_path=str(tmp_path / "runs"),
                run_name="seek",
                checkpoint=checkpoint,
                report_interval="50ba",
                callbacks=[h.RecordRows(records), HeldBlocks(held)],
            ).fit()
        )
        # (d) The stream started on the driver while Ray Train started the worker group, at the position the
        # ranks then asked for: 0, then the checkpoint's (its manifest read on the driver), found started. The
        # feeder's own record (RayResult.data_start), not the log line made from it.
        position = 0 if attempt == 0 else STOP * RUN_BATCH
        start = results[-1].data_start
        assert start is not None and start["prestarted"][:2] == [0, position], start
        assert list(start["asked"])[:2] == [0, position] and start["used"], start
    fresh, resumed = _opened(os.path.join(logs, "opened-0.log")), _opened(os.path.join(logs, "opened-1.log"))
    # The counter sees reads: the fresh start opened the first file, once (one read task reads its 5 row groups).
    assert fresh["part-00.parquet"] == 1, fresh
    # (a) The resume opened no file wholly before row 808: each file from the one holding the position on,
    # once (the row groups are read in byte-sized reads, a file opened once per read).
    assert resumed == Counter({f"part-{i:02d}.parquet": 1 for i in range(20, len(paths))})
    # (b) The exact Timestamp at the stop and at the end, and every row once across both runs, in the same
    # global batches (each the next 8 rows of the order) whatever the world size.
    assert h.timestamp_of(results[0]) == {
        "epoch": 0,
        "batch": STOP,
        "sample": STOP * RUN_BATCH,
        "token": sum(tokens[i] for i in range(STOP * RUN_BATCH)),
    }
    assert h.timestamp_of(results[1]) == {
        "epoch": 1,
        "batch": RUN_BATCHES,
        "sample": RUN_ROWS,
        "token": sum(tokens.values()),
    }
    lineage = h.final_lineage(h.read_records(records))
    assert sorted(lineage) == [(0, b) for b in range(1, RUN_BATCHES + 1)]
    for (_, b), (world, ids) in lineage.items():
        assert world == (2 if b <= STOP else 3), (b, world)
        assert sorted(ids) == list(range((b - 1) * RUN_BATCH, min(b * RUN_BATCH, RUN_ROWS))), b
    # (c) The feeder held a bounded window (two chunks of 16 batches and the pull's look-ahead), far fewer
    # than the 101 row groups before the position, which a re-streamed resume passed over.
    for attempt in (0, 1):
        with open(os.path.join(logs, f"held-{attempt}.log")) as f:
            held_counts = [int(line) for line in f]
        assert held_counts and max(held_counts) <= 40, (attempt, max(held_counts))
