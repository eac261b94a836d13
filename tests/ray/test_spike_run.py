"""`SpikeGuard` through `RayTrainer` on the session's real local Ray: a row planted at a known global
position spikes the loss on one of 2 workers; every rank rolls back at the same batch from its host
snapshot and skips the window; stopped after the rollback and resumed by name on 3 workers, the skip
list holds; the resumed run guards with bisection (``SpikeGuard(bisect=True, row_key="id")``): the planted
row spikes again in epoch 1 (on another rank of 3), the 3 ranks replay the window on halves of its rows
until they agree on row 150 alone, quarantine it and train the rest of the window (nothing skipped); the
run ends at the uninterrupted run's Timestamp with every other row trained once per epoch.

The guard judges the loss only (``grad_zscore=None``): under DDP the gradient norm is the same on
every rank, the loss is each rank's own, so the rank without the planted row acts on the agreement alone.

The order is the dataset's (no shuffle): global batch ``b`` (1-based) of an epoch is rows
``[12 (b - 1), 12 b)``; the planted row 150 is in batch 13, on rank 1 of 2 and of 3.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.callbacks import SpikeGuard
from raytrain_events.checkpoint import CheckpointConfig
from tests import resume_helpers as h

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(h)
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
PLANTED = 150


def _plant(folder: str) -> None:
    """Row ``PLANTED``: inputs scaled by 1e4 and the label flipped (a loss in the hundreds)."""
    for path in sorted(glob.glob(os.path.join(folder, "*.parquet"))):
        table = pq.read_table(path)
        ids = table.column("id").to_numpy()
        if PLANTED not in ids:
            continue
        frame = table.to_pandas()
        at = int(np.flatnonzero(ids == PLANTED)[0])
        frame.at[at, "x"] = np.asarray(frame.at[at, "x"]) * 1e4
        frame.at[at, "y"] = 1 - frame.at[at, "y"]
        pq.write_table(type(table).from_pandas(frame, schema=table.schema, preserve_index=False), path)


class DumpGuard(Callback):
    """Each rank writes its guard's skip list and rollbacks at the end of each fit (one file per rank and fit)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_end(self, state, logger) -> None:
        guard = next(c for c in state.callbacks if isinstance(c, SpikeGuard))
        out = {
            "skips": guard.skips.state_dict()["ranges"],
            "rollbacks": guard.rollbacks,
            "trained": guard.trained(state),
        }
        with open(os.path.join(self.folder, f"guard-{state.world_size}-{state.rank}.json"), "w") as fh:
            json.dump(out, fh)


@pytest.mark.timeout(900)
def test_a_planted_row_rolls_back_from_host_skips_its_window_and_resumes_on_3_workers(ray_cluster, tmp_path):
    import ray.data

    from raytrain_events import RayTrainer

    data = str(tmp_path / "parquet")
    tokens = h.write_parquet(data)
    _plant(data)
    records, dumps = str(tmp_path / "records"), str(tmp_path / "guard")
    os.makedirs(records), os.makedirs(dumps)
    checkpoint = CheckpointConfig(save_interval="5ba", keep=2, save_every_n_seconds=None, autoresume=True)
    for workers, duration, bisect in ((2, "15ba", {}), (3, "2ep", {"bisect": True, "row_key": "id"})):
        result = RayTrainer(
            model=h.make_model,
            optimizers=h.make_sgd,
            datasets={"train": ray.data.read_parquet(data)},
            batch_size=999,  # ignored: global_batch_size fixes the rows per step
            global_batch_size=h.GLOBAL_BATCH,
            get_num_tokens_in_batch=h.count_tokens,
            storage_path=str(tmp_path / "runs"),
            run_name="spiky",
            report_interval="5ba",
            checkpoint=checkpoint,
            max_duration=duration,
            num_workers=workers,
            callbacks=lambda bisect=bisect: [
                h.RecordRows(records),
                SpikeGuard(snapshot_interval=4, warmup=5, grad_zscore=None, **bisect),
                DumpGuard(dumps),
            ],
        ).fit()
    # The uninterrupted run's Timestamp: the skipped rows count as positions (trained + skipped).
    assert h.timestamp_of(result) == h.expected_timestamp(tokens, 2)
    guards = {}
    for path in glob.glob(os.path.join(dumps, "*.json")):
        with open(path) as fh:
            guards[os.path.basename(path)] = json.load(fh)
    assert sorted(guards) == ["guard-2-0.json", "guard-2-1.json", "guard-3-0.json", "guard-3-1.json", "guard-3-2.json"]
    # Epoch 0 at 2 workers: seen on rank 1 at batch 13, agreed by both at 14. Judging the loss alone, the snapshot of
    # batch 12 is passed over (batch 13, the first trained from it, spiked: its weights may hold an unseen blow-up);
    # the one of batch 8 (batch 9's loss judged good) restored, batches 9-14 skipped.
    # Epoch 1 (global batches 18-34) at 3 workers: seen at 30 (batch 13 of the epoch), snapshots at 15 (the
    # resumed fit's start), 19, 23, 27: the one of 27 restored, epoch 1's batches 11-14 (48 rows) replayed by
    # halves; row 150 alone found, quarantined, the rest of the window trained again: nothing skipped.
    first = [[0, 96, 168, 6, sum(tokens[i] for i in range(96, 168))]]
    for name, guard in guards.items():
        rollbacks = [(r["spike_batch"], r["restored_batch"], r["from"], r["skipped"]) for r in guard["rollbacks"]]
        expected = [(13, 8, "host", [[0, 96, 168]])] + ([(30, 27, "host", [])] if "-3-" in name else [])
        assert rollbacks == expected, name
        assert guard["skips"] == first, name
        if "-3-" in name:
            search = guard["rollbacks"][1]
            assert (search["quarantined"], search["retrained"], search["window_rows"]) == ([150], True, 48), name
            assert search["search_rows"] <= 3 * 48, name
    seen = {n: [r["reason"] for r in g["rollbacks"]] for n, g in guards.items()}
    assert "loss" in seen["guard-2-1.json"][0] and seen["guard-2-0.json"][0] == "seen on another rank"
    assert "loss" in seen["guard-3-1.json"][1] and seen["guard-3-2.json"][1] == "seen on another rank"
    skipped = {(0, i) for i in range(96, 168)}
    assert guards["guard-3-0.json"]["trained"] == {  # the quarantined row's tokens counted apart too
        "batch": 34 - 6,
        "sample": 2 * h.ROWS - len(skipped) - 1,
        "token": 2 * sum(tokens.values()) - sum(tokens[i] for _, i in skipped) - tokens[PLANTED],
    }
    # Every other row trained once per epoch (a skipped position's records are of the rolled-back batches; the
    # replayed window's records are its batches as first trained, row 150 among them).
    lineage = h.final_lineage(h.read_records(records))
    for epoch in (0, 1):
        kept = [
            i
            for (e, b), (_, ids) in lineage.items()
            if e == epoch and (epoch, (b - 1) * h.GLOBAL_BATCH) not in skipped
            for i in ids
        ]
        counts = Counter(kept)
        assert sorted(counts) == [i for i in range(h.ROWS) if (epoch, i) not in skipped], epoch
        assert set(counts.values()) == {1}, epoch
    worlds = [lineage[(e, b)][0] for e in (0, 1) for b in range(1, h.BATCHES_PER_EPOCH + 1)]
    assert worlds == [2] * 15 + [3] * 19
