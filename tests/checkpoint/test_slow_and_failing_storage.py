"""Async saves against slow and failing storage: training never waits, failures are survived.

Storage is slowed or broken at the upload functions the `Committer` calls (every byte of a save
goes through them), on a real local filesystem:
* slow (the first upload holds until training has gone 22 batches on): training does not wait for it,
  saves that come due meanwhile are postponed (one warning), and every committed checkpoint loads;
* transient errors (ConnectionError a few times): retried with backoff, the save commits;
* a save that fails for good: logged and recorded in ``failures``, training goes on, the next
  save commits, nothing committed is deleted (keep=2), and the previous checkpoint was "latest"
  meanwhile.
"""

from __future__ import annotations

import logging
import threading

import torch

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.folder.store import latest_checkpoint, list_checkpoints, load_latest_valid
from raytrain_events.checkpoint.format import writer as writer_mod  # write_and_commit looks the writers up here
from raytrain_events.core.callback import Callback
from raytrain_events.trainer import Trainer
from tests.checkpoint.test_trainer_checkpoints import loader, model


def _trainer(folder, callbacks=(), **ckpt):
    m = model()
    config = CheckpointConfig(save_folder=folder, save_every_n_seconds=None, **ckpt)
    return Trainer(
        model=m,
        train_dataloader=loader(),
        max_duration="24ba",
        optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
        checkpoint=config,
        callbacks=list(callbacks),
        seed=1,
    )


def test_slow_storage_never_stalls_training(tmp_path, monkeypatch, caplog):
    # The first save's upload holds until the loop has ended batch 23: a loop that waited for an upload would
    # never get there (the upload gives up waiting after 60 s and the test fails below). Before, each upload
    # slept 0.6 s and every batch gap had to stay under 0.6 s: a wall-clock bound a loaded machine can break.
    released, held = threading.Event(), []
    real = writer_mod.write_checkpoint_file

    def slow(*a, **k):
        assert threading.current_thread() is not threading.main_thread()
        held.append(released.wait(60))  # False: 60 s passed and the loop had not ended batch 23
        return real(*a, **k)

    class Release(Callback):
        def batch_end(self, state, logger):
            if state.step == 23:
                released.set()

    monkeypatch.setattr(writer_mod, "write_checkpoint_file", slow)
    folder = str(tmp_path / "run/checkpoints")
    trainer = _trainer(folder, callbacks=[Release()], save_every_n_steps=1)
    with caplog.at_level(logging.WARNING, logger="raytrain_events.checkpoint.run.checkpointer"):
        trainer.fit()
    # every batch asked for a save; the first upload took 22 batches: the saves due meanwhile were postponed
    assert held and all(held), held
    postponed = [r for r in caplog.records if "is postponed" in r.message]
    assert len(postponed) == 1  # said once
    saved = trainer._checkpointer.saved
    assert 2 <= len(saved) < 24  # fewer saves than asked: the store set the pace
    committed = list_checkpoints(folder)
    assert [c.name for c in committed] == [s.name for s in saved] and [committed[0].batch, committed[-1].batch] == [
        1,
        24,
    ]
    assert load_latest_valid(folder).info.batch == 24


def test_transient_errors_are_retried_until_the_save_commits(tmp_path, monkeypatch):
    real, failures = writer_mod.write_checkpoint_file, {"left": 3}

    def flaky(*a, **k):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("injected: connection reset by peer")
        return real(*a, **k)

    monkeypatch.setattr(writer_mod, "write_checkpoint_file", flaky)
    folder = str(tmp_path / "run/checkpoints")
    trainer = _trainer(folder, save_interval="12ba")
    trainer.fit()
    trainer._checkpointer.close()
    assert failures["left"] == 0 and trainer._checkpointer.failures == []
    assert [c.batch for c in list_checkpoints(folder)] == [12, 24]


def test_a_save_that_fails_for_good_is_reported_and_the_next_one_commits(tmp_path, monkeypatch, caplog):
    real = writer_mod.write_checkpoint_file
    folder = str(tmp_path / "run/checkpoints")
    seen: dict = {}

    class Break(Callback):  # storage fails for good between the saves at batch 8 and batch 16
        def batch_end(self, state, logger):
            if state.step == 9:
                trainer._checkpointer.wait()  # the save at 8 committed
                seen["latest_at_9"] = latest_checkpoint(folder).batch
                monkeypatch.setattr(writer_mod, "write_checkpoint_file", broken)
            if state.step == 14:
                trainer._checkpointer.wait()
                seen["latest_at_14"] = latest_checkpoint(folder).batch
                monkeypatch.setattr(writer_mod, "write_checkpoint_file", real)

    def broken(*a, **k):
        raise ConnectionError("injected: the store is down")

    trainer = _trainer(folder, callbacks=[Break()], save_interval="4ba", keep=2, upload_deadline_s=0.5)
    with caplog.at_level(logging.ERROR, logger="raytrain_events.checkpoint.run.checkpointer"):
        trainer.fit()  # training went on through the failed saves
    trainer._checkpointer.close()
    failed = trainer._checkpointer.failures
    assert len(failed) >= 1 and all("the store is down" in err for _, err in failed)
    assert any("failed (training goes on" in r.message for r in caplog.records)
    # the newest committed before the outage (8, or 4 if the save due at 8 waited for the one at 4)
    # stayed "latest" through the failed saves
    assert seen["latest_at_9"] in (4, 8) and seen["latest_at_14"] == seen["latest_at_9"]
    assert trainer.state.timestamp.get_value("ba") == 24
    # after storage came back: saves commit again (the one due at 16 or 20 may be postponed while a
    # retry runs) and keep=2 pruned only after they did
    batches = [c.batch for c in list_checkpoints(folder)]
    assert len(batches) == 2 and 14 < batches[0] < 24 and batches[1] == 24, batches
