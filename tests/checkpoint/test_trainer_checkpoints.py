"""Checkpointing through the Trainer on file://, memory:// and s3:// (a local S3 server)."""

from __future__ import annotations

import errno
import os
import pickle
import uuid

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.folder.store import latest_checkpoint, list_checkpoints
from raytrain_events.checkpoint.format import writer as ckpt_writer
from raytrain_events.checkpoint.format.manifest import UnsafeCheckpointError
from raytrain_events.checkpoint.run.checkpointer import STATE_FILE
from raytrain_events.core.state import CheckpointMismatchError
from raytrain_events.models import ClassifierModel
from raytrain_events.storage.errors import RunLockedError

N, D = 96, 6


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def loader():
    dataset = data()  # a sampler with set_epoch makes mid-epoch resume exact
    return DataLoader(
        dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    )


def model(hidden=16):
    torch.manual_seed(0)
    return ClassifierModel(
        torch.nn.Sequential(
            torch.nn.Linear(D, hidden), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
        ),
        num_classes=2,
    )


class Crash(Callback):
    def __init__(self, at_batch):
        self.at_batch = at_batch

    def batch_end(self, state, logger):
        if state.step == self.at_batch:
            raise RuntimeError("simulated crash")


def make_trainer(folder, options, *, callbacks=(), hidden=16, **ckpt):
    m = model(hidden)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    config = CheckpointConfig(save_folder=folder, storage_options=options, save_every_n_seconds=None, **ckpt)
    return Trainer(
        model=m,
        train_dataloader=loader(),
        max_duration="3ep",
        optimizers=opt,
        schedulers=sched,
        callbacks=list(callbacks),
        checkpoint=config,
        seed=1,
        config={"lr": 0.1, "hidden": hidden},
    )


def params(trainer):
    return {k: v.clone() for k, v in trainer.state.model.state_dict().items()}


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_after_crash_is_bit_identical(storage, async_save):
    url, options = storage
    full = make_trainer(url + "/a/checkpoints", options, save_every_n_steps=5, async_save=async_save)
    full.fit()
    expected = params(full)
    assert full.state.timestamp.get_value("ba") == 36

    crashed = make_trainer(
        url + "/b/checkpoints", options, callbacks=[Crash(17)], save_every_n_steps=5, async_save=async_save
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    resumed = make_trainer(
        url + "/b/checkpoints", options, save_every_n_steps=5, autoresume=True, async_save=async_save
    )
    # The last committed checkpoint: batch 15 with sync saves. With async saves, a save due while the
    # previous one still uploads is taken at the first batch after it (training never waits), so on a
    # loaded machine the newest may be any save from batch 5 on; resuming from it must still be exact.
    newest = latest_checkpoint(url + "/b/checkpoints", storage_options=options).batch
    assert resumed.state.timestamp.get_value("ba") == newest and (newest == 15 or (async_save and 5 <= newest <= 17))
    resumed.fit()
    assert resumed.state.timestamp.get_value("sp") == full.state.timestamp.get_value("sp")
    for name, value in params(resumed).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keeps_exactly_n(storage, async_save):
    url, options = storage
    trainer = make_trainer(url + "/r/checkpoints", options, save_interval="2ba", keep=3, async_save=async_save)
    trainer.fit()
    infos = list_checkpoints(url + "/r/checkpoints", storage_options=options)
    if not async_save:
        assert [i.batch for i in infos] == [32, 34, 36]
    # Async: every 2 batches, or the first batch after a slow save finished (this tiny model trains all
    # 36 batches faster than one S3 upload, so how many saves come is up to the store): the newest 3 kept.
    saved = trainer._checkpointer.saved
    assert [i.name for i in infos] == [c.name for c in saved[-3:]] and infos[-1].batch == 36


def test_crash_mid_save_leaves_previous_checkpoint_loadable(storage, monkeypatch):
    url, options = storage
    folder = url + "/c/checkpoints"
    real, real_packed = ckpt_writer.write_checkpoint_file, ckpt_writer.write_packed_checkpoint
    calls = {"state": 0}

    def fail_second_state_save() -> None:
        calls["state"] += 1
        if calls["state"] == 2:
            raise OSError(errno.ENOSPC, "disk full while writing state.pt")  # not transient: no retry

    def flaky(ckpt_url, file_name, obj, **kw):  # the multi-file layout (local)
        if file_name == STATE_FILE:
            fail_second_state_save()
        return real(ckpt_url, file_name, obj, **kw)

    def flaky_packed(ckpt_url, *, files, **kw):  # one packed object (object stores)
        assert STATE_FILE in files
        fail_second_state_save()
        return real_packed(ckpt_url, files=files, **kw)

    monkeypatch.setattr("raytrain_events.checkpoint.format.writer.write_checkpoint_file", flaky)
    monkeypatch.setattr("raytrain_events.checkpoint.format.writer.write_packed_checkpoint", flaky_packed)
    trainer = make_trainer(folder, options, save_every_n_steps=4, async_save=False)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit()
    monkeypatch.undo()
    assert calls["state"] == 2
    assert [i.batch for i in list_checkpoints(folder, storage_options=options)] == [4]
    resumed = make_trainer(folder, options, autoresume=True)
    assert resumed.state.timestamp.get_value("ba") == 4


def test_checkpoint_from_another_model_is_refused_clearly(tmp_path):
    make_trainer(str(tmp_path / "m/checkpoints"), {}, save_interval="1ep").fit()
    with pytest.raises(CheckpointMismatchError, match="does not match this model.*shape mismatch"):
        make_trainer(str(tmp_path / "other/checkpoints"), {}, hidden=32, load_from=str(tmp_path / "m/checkpoints"))
    # The failed load released the run dir lock: the same run can start again.
    make_trainer(str(tmp_path / "other/checkpoints"), {}, hidden=32).close()


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = f"/tmp/raytrain-pwned-{uuid.uuid4().hex}"


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path):
    folder = str(tmp_path / "evil/checkpoints")
    make_trainer(folder, {}, save_interval="3ep").fit()
    info = list_checkpoints(folder)[-1]
    # An attacker rewrites state.pt AND its manifest checksum: only weights_only loading stops it.
    payload = pickle.dumps({"model": _Evil()})
    ckpt_writer.write_checkpoint(str(tmp_path / "evil2"), files={}, timestamp=info.timestamp, world_size=1)
    bad = list_checkpoints(str(tmp_path / "evil2"))[-1]
    from raytrain_events.storage.fs import resolve

    fs, path = resolve(bad.url)
    with open(os.path.join(path, STATE_FILE), "wb") as f:
        f.write(payload)
    manifest = bad.manifest()
    import hashlib
    import json

    manifest["files"] = [{"name": STATE_FILE, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}]
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(UnsafeCheckpointError):
        make_trainer(str(tmp_path / "victim/checkpoints"), {}, load_from=bad.url)
    assert not os.path.exists(MARKER)


def test_second_run_on_a_locked_run_dir_is_refused(tmp_path):
    first = make_trainer(str(tmp_path / "run/checkpoints"), {})
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}|{os.getpid()}"):
        make_trainer(str(tmp_path / "run/checkpoints"), {})
    first.close()
    first._checkpointer.close()
    make_trainer(str(tmp_path / "run/checkpoints"), {})._checkpointer.close()


def test_resume_with_a_different_config_logs_the_diff(tmp_path, caplog):
    make_trainer(str(tmp_path / "d/checkpoints"), {}, save_interval="1ep").fit()
    caplog.set_level("WARNING", logger="raytrain_events.checkpoint.run.loading")
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    Trainer(
        model=m,
        train_dataloader=loader(),
        max_duration="3ep",
        optimizers=opt,
        schedulers=sched,
        seed=1,
        config={"lr": 0.05, "hidden": 16},
        checkpoint=CheckpointConfig(save_folder=str(tmp_path / "d/checkpoints"), autoresume=True),
    )._checkpointer.close()
    out = "\n".join(r.getMessage() for r in caplog.records if r.name == "raytrain_events.checkpoint.run.loading")
    assert "different config" in out and "lr: 0.1" in out and "lr: 0.05" in out


def test_single_process_async_save_writes_every_file_off_the_training_thread(tmp_path, monkeypatch):
    import threading

    from raytrain_events.checkpoint.format import writer as ckmod

    real, writers = ckpt_writer.write_checkpoint_file, []

    def spy(ckpt_url, file_name, obj, **kw):
        writers.append((file_name, threading.current_thread() is threading.main_thread()))
        return real(ckpt_url, file_name, obj, **kw)

    def no_listing(*a, **k):
        raise AssertionError("commit listed files that this process uploaded itself")

    monkeypatch.setattr(ckmod, "write_checkpoint_file", spy)
    monkeypatch.setattr(ckpt_writer, "list_dir", no_listing)
    folder = str(tmp_path / "t/checkpoints")
    trainer = make_trainer(folder, {}, save_interval="1ep", async_save=True)
    trainer.fit()
    trainer._checkpointer.close()
    assert {name for name, _ in writers} == {STATE_FILE, ckpt_writer.rng_file_name(0)}
    assert not any(on_main for _, on_main in writers), writers  # the training thread only copies
    # One save per epoch; an epoch's save due while the previous one still uploads comes a few batches late.
    batches = [i.batch for i in list_checkpoints(folder)]
    assert batches[0] == 12 and batches[-1] == 36 and len(batches) in (2, 3), batches
    resumed = make_trainer(folder, {}, autoresume=True)  # the RNG file was committed and loads
    assert resumed.state.timestamp.get_value("ba") == 36


def test_a_save_and_a_load_resolve_the_checkpoint_url_once(tmp_path, monkeypatch):
    """A checkpoint's URL becomes a `Location` once per save (`Checkpointer.save`) and once per
    `read_checkpoint`, passed down whole: the writer used to resolve it again for each file and for the
    commit (4 times for a save of two files), the reader again for the files after the manifest."""
    import fsspec

    from raytrain_events.checkpoint import read_checkpoint

    real, resolved = fsspec.core.url_to_fs, []

    def counting(url, **kwargs):
        if "/ckpt-" in str(url):
            resolved.append(str(url))
        return real(url, **kwargs)

    monkeypatch.setattr(fsspec.core, "url_to_fs", counting)
    trainer = make_trainer(str(tmp_path / "run" / "checkpoints"), {}, save_every_n_steps=6, async_save=False)
    trainer.fit()
    saves = trainer.state.timestamp.batch.value // 6
    assert saves >= 2 and len(resolved) == saves, resolved  # one per save (the final save is a step's save)
    latest = latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert latest is not None and len(latest.files) == 2  # state.pt and rng-rank0.pt: the multi-file layout
    resolved.clear()
    loaded = read_checkpoint(latest.url)
    assert set(loaded.files) == {f.name for f in latest.files} and len(resolved) == 1, resolved
