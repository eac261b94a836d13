"""Shared parts of the resume tests: a multi-file Parquet dataset with row ids, a callback that
records which rows each batch trained, and the checks that every row is trained exactly once
per epoch (in the run's final lineage: a batch trained again after a restart counts once)."""

from __future__ import annotations

import glob
import json
import os
import time
from collections import Counter, defaultdict
from typing import Optional

import numpy as np
import torch

from raytrain_events import Callback
from raytrain_events.models import ClassifierModel

DIM = 4
FILE_ROWS = (101, 67, 35)  # 203 rows, odd, in 3 files
ROWS = sum(FILE_ROWS)
GLOBAL_BATCH = 12  # 203 = 16 * 12 + 11: 17 global batches per epoch whatever the world size (1-3)
BATCHES_PER_EPOCH = 17


def write_parquet(folder: str, file_rows=FILE_ROWS, row_group_size: Optional[int] = None) -> dict:
    """Parquet files (three by default) of rows ``id, x, y, ntok``, ids in file order; returns the ids'
    token counts. ``row_group_size``: rows per row group (default: one per file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    start = 0
    tokens = {}
    for i, n in enumerate(file_rows):
        ids = np.arange(start, start + n)
        x = rng.normal(size=(n, DIM)).astype(np.float32)
        ntok = rng.integers(1, 10, size=n)
        table = pa.table(
            {
                "id": ids,
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
                "y": (x[:, 0] > 0).astype(np.int64),
                "ntok": ntok,
            }
        )
        pq.write_table(table, os.path.join(folder, f"part-{i}.parquet"), row_group_size=row_group_size)
        tokens.update(zip(ids.tolist(), ntok.tolist()))
        start += n
    return tokens


def make_model():
    torch.manual_seed(0)
    return ClassifierModel(
        torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), num_classes=2
    )


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def count_tokens(batch):
    return int(batch["ntok"].sum())


class RecordRows(Callback):
    """Appends, per trained batch, ``{t, world, epoch, batch_in_epoch, ids}`` to a file per process.

    ``t`` is the process's fit start (one attempt of the worker group); the records survive a
    SIGKILL (one line per batch, flushed). ``sleep_s`` slows batches down so that a test can
    act (kill a worker, remove a node) mid-epoch; ``alone_sleep_s``, if given, replaces it while
    the group has one worker, so that an elastic run is still training when Ray grows it back.
    """

    def __init__(self, folder: str, sleep_s: float = 0.0, alone_sleep_s: Optional[float] = None):
        self.folder, self.sleep_s, self.alone_sleep_s = folder, sleep_s, alone_sleep_s

    def fit_start(self, state, logger):
        self.t = time.time()
        self.file = open(os.path.join(self.folder, f"rows-{os.getpid()}-{state.rank}.jsonl"), "a")

    def batch_end(self, state, logger):
        record = {
            "t": self.t,
            "world": state.world_size,
            "epoch": state.timestamp.epoch.value,
            "batch_in_epoch": state.timestamp.batch_in_epoch.value,
            "ids": [int(i) for i in state.batch["id"].tolist()],
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        sleep_s = self.alone_sleep_s if self.alone_sleep_s is not None and state.world_size == 1 else self.sleep_s
        if sleep_s:
            time.sleep(sleep_s)

    def fit_end(self, state, logger):
        self.file.close()


class KillFeederAt(Callback):
    """Rank 0 kills the train feeder's process (Ray restarts it) at global batch ``step``, once (a marker remembers)."""

    def __init__(self, folder: str, step: int) -> None:
        self.folder, self.step = folder, step

    def batch_end(self, state, logger) -> None:
        import ray

        marker = os.path.join(self.folder, "feeder-killed")
        if state.rank == 0 and state.step == self.step and not os.path.exists(marker):
            open(marker, "w").close()
            ray.kill(state.train_dataloader.shard.feeder, no_restart=False)


def materialized_in_order(dataset):
    """The dataset materialized with its rows in file order (its own context's ``preserve_order``)."""
    dataset.context.execution_options.preserve_order = True
    return dataset.materialize()


def read_records(folder: str) -> list:
    records = []
    for path in glob.glob(os.path.join(folder, "rows-*.jsonl")):
        with open(path) as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return records


def final_lineage(records: list, gap_s: float = 3.0) -> dict:
    """``{(epoch, batch_in_epoch): (world size, [ids])}`` from the last attempt that trained each batch.

    Attempts are told apart by their fit start times (one group starts within ``gap_s``).
    """
    by_batch = defaultdict(list)
    for r in records:
        by_batch[(r["epoch"], r["batch_in_epoch"])].append(r)
    lineage = {}
    for key, rs in by_batch.items():
        last = max(r["t"] for r in rs)
        chosen = [r for r in rs if r["t"] > last - gap_s]
        worlds = {r["world"] for r in chosen}
        assert len(worlds) == 1, f"batch {key} was trained by groups of sizes {worlds} at once"
        world = worlds.pop()
        assert len(chosen) == world, f"batch {key}: {len(chosen)} rank records for a group of {world}"
        lineage[key] = (world, [i for r in chosen for i in r["ids"]])
    return lineage


def assert_every_row_once_per_epoch(folder: str, epochs: int, batches: Optional[dict] = None) -> dict:
    """Every row id is trained exactly once in each epoch; returns the lineage.

    The global batches must be the same whatever the world size: ``batches`` (``{(epoch, batch):
    sorted ids}``, e.g. `global_batches` of a reference run), by default the unshuffled order's
    consecutive ids."""
    lineage = final_lineage(read_records(folder))
    for epoch in range(epochs):
        numbers = sorted(b for (e, b) in lineage if e == epoch)
        assert numbers == list(range(1, BATCHES_PER_EPOCH + 1)), (epoch, numbers)
        counts = Counter(i for (e, _), (_, ids) in lineage.items() if e == epoch for i in ids)
        assert sorted(counts) == list(range(ROWS)), f"epoch {epoch}: missing {sorted(set(range(ROWS)) - set(counts))}"
        twice = {i: c for i, c in counts.items() if c != 1}
        assert not twice, f"epoch {epoch}: rows trained more than once: {twice}"
        for b in numbers:  # the global batches are the same whatever the world size
            expected = list(range((b - 1) * GLOBAL_BATCH, min(b * GLOBAL_BATCH, ROWS)))
            if batches is not None:
                expected = batches[(epoch, b)]
            assert sorted(lineage[(epoch, b)][1]) == expected, (epoch, b)
    return lineage


def global_batches(lineage: dict) -> dict:
    """``{(epoch, batch): sorted ids}`` of a lineage (`final_lineage`)."""
    return {key: sorted(ids) for key, (_, ids) in lineage.items()}


def shuffle_quality(folder: str) -> dict:
    """How mixed the trained batches are (the measures of ``bench/shuffle_quality.py``, over the
    records: a block is one Parquet file of `FILE_ROWS`): the share of adjacent rows in a rank's
    batch that are consecutive ids, the median id gap between them, and the mean share of a global
    batch from its most common file."""
    records = read_records(folder)
    pairs = np.concatenate([np.diff(r["ids"]) for r in records if len(r["ids"]) > 1])
    bounds = np.cumsum(FILE_ROWS)
    shares = []
    for _, ids in final_lineage(records).values():
        _, counts = np.unique(np.searchsorted(bounds, ids, side="right"), return_counts=True)
        shares.append(counts.max() / len(ids))
    return {
        "consecutive": float(np.mean(pairs == 1)),
        "gap": float(np.median(np.abs(pairs))),
        "same_file_share": float(np.mean(shares)),
    }


def expected_timestamp(tokens: dict, epochs: int) -> dict:
    return {
        "epoch": epochs,
        "batch": BATCHES_PER_EPOCH * epochs,
        "sample": ROWS * epochs,
        "token": sum(tokens.values()) * epochs,
    }


def timestamp_of(result) -> dict:
    return {unit: result.timestamp.get_value(short) for unit, short in _UNITS.items()}


_UNITS = {"epoch": "ep", "batch": "ba", "sample": "sp", "token": "tok"}
