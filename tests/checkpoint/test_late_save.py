"""`Checkpointer.save_late`: a save made at the next batch for save points whose saver died before committing them
(replica groups' next lead, `ray/replica_groups.lead_saves`), recorded in its manifest; a plain `Trainer`, no Ray."""

from __future__ import annotations

from raytrain_events import Callback
from raytrain_events.checkpoint.folder.store import list_checkpoints
from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
from raytrain_events.core.save_points import LateSave
from tests.checkpoint.test_trainer_checkpoints import make_trainer


class AskLate(Callback):
    """Before batch 5 is trained, ask for a late save standing in for the save point at batch 3."""

    def after_dataloader(self, state, logger) -> None:
        if int(state.timestamp.batch) == 4:
            find_checkpointer(state).save_late(LateSave((3,)))


def test_a_late_save_is_made_once_at_the_next_batch_and_its_manifest_names_the_missed_save_points(tmp_path):
    folder = str(tmp_path / "checkpoints")
    trainer = make_trainer(folder, {}, callbacks=[AskLate()], save_interval="1ep", keep=None, async_save=False)
    trainer.fit()
    saved = {c.batch: c.metadata.get("late_for") for c in list_checkpoints(folder)}
    per_epoch = int(trainer.state.timestamp.batch) // 3
    assert saved == {5: [3], per_epoch: None, 2 * per_epoch: None, 3 * per_epoch: None}, saved
    late = [s for s in find_checkpointer(trainer.state).saved if s.late_for]
    assert [(s.late_for, s.name.startswith("ckpt-000000000005")) for s in late] == [((3,), True)]
