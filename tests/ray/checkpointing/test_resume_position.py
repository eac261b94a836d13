"""`resume_position`: where the driver guesses a run's train data starts, to start the stream early.

Real checkpoints on a local disk, no Ray: the newest committed checkpoint's ``data_position`` (its
manifest, read through the folder's index), an epoch start when the save was at one, (0, 0) for a
run without checkpoints. A wrong guess costs only the early reads (the feeder then starts where the
ranks ask: tests/data/ray/test_global_order.py); the guess through `RayTrainer` is checked in
tests/data/ray/test_parquet_seek.py's resumed run.
"""

from __future__ import annotations

import torch

from raytrain_events.checkpoint import CheckpointConfig
from raytrain_events.checkpoint.folder.retention import ray_plan
from raytrain_events.checkpoint.format.writer import write_checkpoint
from raytrain_events.ray.checkpointing.checkpointing import resume_position
from raytrain_events.storage.run_dir import checkpoints_url


def _save(folder: str, batch: int, epoch: int, batch_in_epoch: int, sample_in_epoch: int) -> None:
    position = dict(epoch=epoch, batch_in_epoch=batch_in_epoch, sample_in_epoch=sample_in_epoch, seed=0, world_size=2)
    write_checkpoint(
        folder,
        files={"state.pt": {"w": torch.ones(1)}},
        timestamp={"batch": batch, "epoch": epoch, "sample": batch * 8},
        world_size=2,
        metadata={"data_position": position},
    )


def test_the_guess_is_the_newest_checkpoints_data_position(tmp_path):
    run_url = str(tmp_path / "run")
    plan = ray_plan(CheckpointConfig(save_interval="5ba"), run_url=run_url, storage_options={})
    assert resume_position(plan) == (0, 0)  # nothing saved yet: a fresh start
    folder = checkpoints_url(run_url)
    _save(folder, 10, epoch=0, batch_in_epoch=10, sample_in_epoch=80)
    _save(folder, 30, epoch=1, batch_in_epoch=5, sample_in_epoch=40)
    assert resume_position(plan) == (1, 40)
    _save(folder, 50, epoch=2, batch_in_epoch=0, sample_in_epoch=0)  # saved at an epoch's start
    assert resume_position(plan) == (2, 0)
    assert resume_position(None) == (0, 0)  # a run without checkpoints
