"""The end of a run whose last batch is a save point (no Ray).

* The final checkpoint is the end's: its Timestamp counts the last epoch, and it is the only one at that batch.
  Before, the save at the last batch (taken before the epoch ended) was the newest, and the end-of-fit save was
  skipped as "this batch is saved", so the run's final checkpoint recorded the epoch before the end.
* So a replica group replaced after the others finished (`ray/replica_groups._run_finished`) sees the run
  finished and loads its end, instead of waiting for a quorum no other group will join.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from raytrain_events import CheckpointConfig, Trainer
from raytrain_events.checkpoint.folder.store import latest_checkpoint, list_checkpoints
from raytrain_events.ray.replica_groups import _run_finished
from tests.resume_helpers import make_model, make_sgd

ROWS, BATCH, EPOCHS = 16, 4, 2  # 4 batches per epoch: the last batch (8) is a save point of "4ba"


def _fit(folder: str, duration: str) -> Trainer:
    data = [{"x": torch.randn(4), "y": i % 2} for i in range(ROWS)]
    model = make_model()
    config = CheckpointConfig(save_folder=folder, save_interval="4ba", lock_run_dir=False)
    trainer = Trainer(
        model=model,
        optimizers=make_sgd(model),
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=BATCH),
        max_duration=duration,
        checkpoint=config,
    )
    trainer.fit()
    return trainer


def test_a_save_point_at_the_last_batch_leaves_the_ends_checkpoint(tmp_path):
    folder = str(tmp_path / "checkpoints")
    trainer = _fit(folder, f"{EPOCHS}ep")
    assert (int(trainer.state.timestamp.epoch), int(trainer.state.timestamp.batch)) == (EPOCHS, 8)
    info = latest_checkpoint(folder)
    assert (info.timestamp["epoch"], info.timestamp["batch"]) == (EPOCHS, 8), info.timestamp  # before: (1, 8)
    assert [c.batch for c in list_checkpoints(folder)] == [4, 8]  # one save at batch 8: the end's
    model = make_model()
    loaded = Trainer(
        model=model,
        optimizers=make_sgd(model),
        max_duration=f"{EPOCHS}ep",
        checkpoint=CheckpointConfig(load_from=info.url, save_folder=str(tmp_path / "local"), lock_run_dir=False),
    )
    assert int(loaded.state.timestamp.epoch) == EPOCHS


def test_a_group_replaced_after_the_end_sees_the_run_finished(tmp_path):
    folder = str(tmp_path / "checkpoints")
    _fit(folder, f"{EPOCHS}ep")
    worker = SimpleNamespace(save_folder=folder, storage_options={})
    model = make_model()
    replaced = Trainer(model=model, optimizers=make_sgd(model), max_duration=f"{EPOCHS}ep")  # a new group's state
    assert _run_finished(replaced.state, worker)  # before: the newest checkpoint said epoch 1, "not finished"
    assert int(replaced.state.timestamp.batch) == 0  # asked without moving the group's own state
    other = make_model()
    longer = Trainer(model=other, optimizers=make_sgd(other), max_duration=f"{EPOCHS + 1}ep")
    assert not _run_finished(longer.state, worker)  # a run that goes on is not finished
