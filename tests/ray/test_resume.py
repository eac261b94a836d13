"""Runs that survive: exact global Timestamps and every row once per epoch across restarts.

On the session's real local Ray (4 CPUs), a 3-file Parquet dataset with an odd row count
(203 rows) and a fixed global batch of 12 rows (17 batches per epoch at any world size):

* an uninterrupted 2-worker run: the reference Timestamp;
* a worker SIGKILLed twice mid-epoch, off checkpoint boundaries, on the default streaming path
  (Ray's FailureConfig restarts the group from the newest checkpoint), keep=2;
* one run continued by name twice with 2, then 3, then 1 workers (keep=1, Ray's run snapshot),
  and a new run started from its mid-epoch checkpoint with ``load_from``;
* a cluster whose CPUs the workers would all take is refused before training.

Each checks, through `RecordRows`, that every row id is trained exactly once per epoch in the
run's final lineage and that the global batches are the same rows whatever the world size. The
reference and the resumed runs shuffle (`SHUFFLE`: blocks and rows within 64-row windows by seed +
epoch): their batches mix rows from across a window, and the runs at 2, 3 and 1 workers and the
``load_from`` branch train the reference's global batches.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.checkpoint import CheckpointConfig, list_checkpoints
from raytrain_events.checkpoint.index import INDEX_FILE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_helpers as h  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(h)  # ship the helpers to the workers
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
SHUFFLE = {"seed": 3, "shuffle_buffer_size": 64}  # RayTrainer's row shuffle: rows permuted within 64-row windows


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("parquet"))
    return folder, h.write_parquet(folder)


def _trainer(folder, records, storage, **kw):
    import ray.data

    from raytrain_events import RayTrainer

    callbacks = kw.pop("callbacks", [])
    sleep_s = kw.pop("sleep_s", 0.0)
    return RayTrainer(
        model=h.make_model,
        optimizers=h.make_sgd,
        datasets={"train": ray.data.read_parquet(folder)},
        batch_size=999,  # ignored: global_batch_size fixes the rows per step
        global_batch_size=h.GLOBAL_BATCH,
        get_num_tokens_in_batch=h.count_tokens,
        storage_path=storage,
        report_interval="5ba",
        callbacks=lambda: [h.RecordRows(records, sleep_s)] + list(callbacks),
        **kw,
    )


@pytest.fixture(scope="module")
def reference(ray_cluster, parquet, tmp_path_factory):
    folder, tokens = parquet
    tmp = tmp_path_factory.mktemp("reference")
    records = str(tmp / "records")
    os.makedirs(records)
    result = _trainer(
        folder, records, str(tmp / "runs"), max_duration="2ep", num_workers=2, run_name="ref", **SHUFFLE
    ).fit()
    return result, records


def test_uninterrupted_run_is_exact(reference, parquet):
    result, records = reference
    _, tokens = parquet
    assert h.timestamp_of(result) == h.expected_timestamp(tokens, 2)
    batches = h.global_batches(h.final_lineage(h.read_records(records)))
    h.assert_every_row_once_per_epoch(records, 2, batches)
    # The shuffle is on: adjacent rows of a rank's batch are rarely consecutive ids (1.0 unshuffled; ~1/64
    # within 64-row windows), they lie far apart, and the two epochs are two orders.
    quality = h.shuffle_quality(records)
    print(f"shuffle quality of the RayTrainer path: {quality}")
    assert quality["consecutive"] < 0.2 and quality["gap"] >= 8, quality
    assert [batches[(0, b)] for b in range(1, 18)] != [batches[(1, b)] for b in range(1, 18)]


class KillAt(Callback):
    """SIGKILLs rank 1's process at global batches ``steps`` (once each; marker files remember)."""

    def __init__(self, folder, steps):
        self.folder, self.steps = folder, steps

    def batch_end(self, state, logger):
        marker = os.path.join(self.folder, f"killed-{state.step}")
        if state.rank == 1 and state.step in self.steps and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)


@pytest.mark.timeout(1800)  # several Ray runs; minutes each on a loaded machine
def test_worker_killed_twice_mid_epoch_resumes_exactly(reference, parquet, tmp_path):
    folder, tokens = parquet
    records = str(tmp_path / "records")
    os.makedirs(records)
    # Checkpoints every 5 batches; kills at 8 (epoch 0) and 23 (epoch 1, batch 6): off the boundaries.
    result = _trainer(
        folder,
        records,
        str(tmp_path / "runs"),
        max_duration="2ep",
        num_workers=2,
        run_name="killed",
        checkpoint=CheckpointConfig(save_interval="5ba", keep=2, save_every_n_seconds=None),
        max_failures=2,
        callbacks=[KillAt(str(tmp_path), (8, 23))],
    ).fit()
    assert os.path.exists(tmp_path / "killed-8") and os.path.exists(tmp_path / "killed-23")
    assert h.timestamp_of(result) == h.timestamp_of(reference[0])
    lineage = h.assert_every_row_once_per_epoch(records, 2)
    assert {world for world, _ in lineage.values()} == {2}
    # Three worker groups trained (two restarts); one group file of row records per process.
    assert len(os.listdir(records)) == 3 * 2
    # A group killed before Ray's controller collected its last report round leaves no history entry
    # for that round (the group's first checkpoint is still resumed from: it is committed in the run
    # dir), so the history numbers 2 or 3 attempts depending on timing.
    assert max(e["attempt"] for e in result.history) in (2, 3)
    # keep=2, one owner (Ray): two committed checkpoints left, the newest is Ray's result checkpoint.
    committed = list_checkpoints(str(tmp_path / "runs" / "killed" / "checkpoints"))
    # (30, or a batch or two later when the save at 25 was still uploading: saves never make training wait)
    assert len(committed) == 2 and 30 <= committed[0].batch < 34 and committed[1].batch == 34
    assert result.ray_result.checkpoint.path.rstrip("/").endswith(committed[-1].name)
    on_disk = [n for n in os.listdir(tmp_path / "runs" / "killed" / "checkpoints") if n != INDEX_FILE]
    assert sorted(on_disk) == sorted(c.name for c in committed)


@pytest.mark.timeout(1800)  # several Ray runs; minutes each on a loaded machine
def test_resume_by_name_with_2_then_3_then_1_workers(reference, parquet, tmp_path):
    folder, tokens = parquet
    records = str(tmp_path / "records")
    os.makedirs(records)
    storage = str(tmp_path / "runs")
    checkpoint = CheckpointConfig(save_interval="4ba", keep=1, save_every_n_seconds=None, autoresume=True)
    # Stops mid-epoch at global batches 20 (epoch 1, batch 3) and 29 (epoch 1, batch 12), then finishes.
    for workers, duration in ((2, "20ba"), (3, "29ba"), (1, "2ep")):
        result = _trainer(
            folder,
            records,
            storage,
            max_duration=duration,
            num_workers=workers,
            run_name="grow",
            checkpoint=checkpoint,
            **SHUFFLE,
        ).fit()
        committed = list_checkpoints(os.path.join(storage, "grow", "checkpoints"))
        assert len(committed) == 1  # keep=1, and Ray's snapshot still names only what exists
        assert result.ray_result.checkpoint.path.rstrip("/").endswith(committed[-1].name)
        if duration == "29ba":
            _check_load_from_another_run(folder, storage, committed[-1], reference, tmp_path)
    assert h.timestamp_of(result) == h.timestamp_of(reference[0])
    # The reference's shuffled global batches, at 2, 3 and 1 workers across two resumes.
    lineage = h.assert_every_row_once_per_epoch(records, 2, _reference_batches(reference))
    worlds = [lineage[(1, b)][0] for b in range(1, h.BATCHES_PER_EPOCH + 1)]
    assert worlds == [2] * 3 + [3] * 9 + [1] * 5


def _reference_batches(reference):
    return h.global_batches(h.final_lineage(h.read_records(reference[1])))


def _check_load_from_another_run(folder, storage, donor, reference, tmp_path):
    """A new run started from another run's mid-epoch checkpoint (``load_from``) continues from its
    exact Timestamp and trains exactly the rows the donor had not trained in that epoch; the donor's
    checkpoint stays where it was (the new run saves and prunes only in its own run dir)."""
    records = str(tmp_path / "branch-records")
    os.makedirs(records)
    checkpoint = CheckpointConfig(save_interval="4ba", keep=1, save_every_n_seconds=None, load_from=donor.url)
    result = _trainer(
        folder, records, storage, max_duration="2ep", num_workers=2, run_name="branch", checkpoint=checkpoint, **SHUFFLE
    ).fit()
    assert h.timestamp_of(result) == h.timestamp_of(reference[0])
    lineage = h.final_lineage(h.read_records(records))
    done_in_epoch = donor.batch - h.BATCHES_PER_EPOCH  # the donor stopped in epoch 1
    assert sorted(lineage) == [(1, b) for b in range(done_in_epoch + 1, h.BATCHES_PER_EPOCH + 1)]
    batches = _reference_batches(reference)
    for key, (_, ids) in lineage.items():  # the same global batches as an uninterrupted run
        assert sorted(ids) == batches[key], key
    assert [c.name for c in list_checkpoints(os.path.join(storage, "grow", "checkpoints"))] == [donor.name]
    branch = list_checkpoints(os.path.join(storage, "branch", "checkpoints"))
    assert [c.batch for c in branch] == [2 * h.BATCHES_PER_EPOCH]


def test_cpu_starved_cluster_is_refused_before_training(ray_cluster, parquet, tmp_path):
    import ray.data

    from raytrain_events import RayTrainer

    cpus = int(ray_cluster.cluster_resources()["CPU"])
    trainer = RayTrainer(
        model=h.make_model,
        optimizers=h.make_sgd,
        datasets={"train": ray.data.read_parquet(parquet[0])},
        max_duration="1ep",
        num_workers=cpus,
        storage_path=str(tmp_path),
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        trainer.fit()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert f"has {cpus} CPUs and the {cpus} train workers take 1 each" in message
    for remedy in ("fewer workers", "resources_per_worker", "larger cluster", "let RayTrainer start Ray"):
        assert remedy in message
