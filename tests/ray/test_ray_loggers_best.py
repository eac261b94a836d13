"""One 2-worker RayTrainer run for two features: loggers on Ray and best checkpoints by metric.

* ``driver_loggers=[TensorBoardLogger]``: the event files hold one series per metric (not one per rank),
  each point once per report round, with the global sample count as its step.
* ``CheckpointConfig(keep_best=1, metric=..., mode="max")`` through a run whose metric goes up then
  down: the best checkpoint and the newest one survive, the others are pruned, and
  `RayResult.best_checkpoint` / ``latest_checkpoint`` name them.
"""

from __future__ import annotations

import glob
import os
import struct
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.models import ClassifierModel

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, DIM, BATCH, WORKERS = 128, 8, 16, 2
SCORES = [0.2, 0.9, 0.5, 0.3]  # the "eval" score at the end of epochs 1..4: up, then down


def make_model():
    torch.manual_seed(0)
    return ClassifierModel(torch.nn.Linear(DIM, 2), num_classes=2)


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


class EpochScore(Callback):
    """Logs a made-up eval score each epoch (the same on every rank, like a synced torchmetric)."""

    def epoch_end(self, state, logger):
        logger.log_metrics({"metrics/eval/score": SCORES[state.timestamp.epoch.value - 1]})


def read_scalars(folder):
    """tag -> [(step, value)] from every TensorBoard event file under ``folder`` (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    series = defaultdict(list)
    for path in glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                series[value.tag].append((event.step, value.simple_value))
    return series


def test_tensorboard_series_per_metric_and_keep_best_through_up_then_down(tmp_path, ray_cluster):
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.loggers import TensorBoardLogger

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    rows = [{"x": x[i], "y": int(x[i, 0] > 0)} for i in range(ROWS)]
    tb_dir = str(tmp_path / "tb")
    result = RayTrainer(
        model=make_model,
        optimizers=make_sgd,
        datasets={"train": ray.data.from_items(rows)},
        max_duration=f"{len(SCORES)}ep",
        batch_size=BATCH,
        num_workers=WORKERS,
        deterministic_split=True,
        callbacks=lambda: [EpochScore()],
        report_interval="1ep",
        report_every_s=None,
        storage_path=str(tmp_path / "runs"),
        run_name="best",
        # Saves written before training goes on: an asynchronous save still uploading when the next comes due
        # postpones it (by design, `Checkpointer`), so which batches get checkpoints would depend on the machine's
        # load (beside a second test stream: epochs 2 and 3 unsaved). Reports due meanwhile are tested without Ray
        # (tests/ray/reports/test_report_preemption.py: they reach the loggers at their own points).
        checkpoint=CheckpointConfig(
            save_interval="1ep",
            keep_best=1,
            metric="metrics/eval/score",
            mode="max",
            save_every_n_seconds=None,
            async_save=False,
        ),
        driver_loggers=[TensorBoardLogger(tb_dir, flush_secs=1)],
        log_step="sample",
    ).fit()

    samples_per_epoch = ROWS  # both workers together
    # TensorBoard: one series per metric, one point per epoch report, the global sample count as step.
    series = read_scalars(tb_dir)
    assert [v for _, v in series["metrics/eval/score"]] == pytest.approx(SCORES)
    for tag in ("metrics/eval/score", "train/loss", "train/lr"):
        assert [s for s, _ in series[tag]] == [samples_per_epoch * (i + 1) for i in range(len(SCORES))], tag
    assert not [t for t in series if "rank" in t]
    assert len(glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True)) == 1

    # keep_best=1: the best (epoch 2, score 0.9) and the newest (epoch 4) survive on disk.
    kept = sorted(c.timestamp["epoch"] for c in result.checkpoints)
    assert kept == [2, 4]
    assert result.best_checkpoint.timestamp["epoch"] == 2
    assert result.latest_checkpoint.timestamp["epoch"] == 4
    on_disk = sorted(os.listdir(tmp_path / "runs" / "best" / "checkpoints"))
    assert len([d for d in on_disk if d.startswith("ckpt-")]) == 2, on_disk
