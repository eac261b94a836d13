"""Commits cost O(1) storage requests however many checkpoints precede them; the index heals itself.

Counted at the S3 API (every request s3fs sends to the local S3 server): a Trainer saving every
batch, synchronously, 50 times, with keep=None (the cost used to grow by a GET per checkpoint) and
keep=3 (pruning deletes without listing). Then the index's failure modes: a crash between commit
and index update, a missing or garbled index, checkpoints deleted behind its back.
"""

from __future__ import annotations

import collections
import os
import uuid

import pytest
import torch

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.folder.committer import Committer
from raytrain_events.checkpoint.folder.folder import CheckpointFolder
from raytrain_events.checkpoint.folder.index import INDEX_FILE, CheckpointIndex
from raytrain_events.checkpoint.folder.store import latest_checkpoint, list_checkpoints, load_latest_valid
from raytrain_events.checkpoint.format.writer import write_checkpoint
from raytrain_events.storage import fs as sfs
from raytrain_events.trainer import Trainer
from tests.checkpoint.test_trainer_checkpoints import loader, model


def _counting(fs, calls, listed):
    real = fs._call_s3

    async def counting(method, *a, **k):
        calls.append(method)
        if method == "list_objects_v2":
            listed.append(k.get("Prefix", ""))
        return await real(method, *a, **k)

    fs._call_s3 = counting  # resolve() hands out this same cached instance
    return real


@pytest.mark.parametrize("keep", [None, 3])
def test_commit_requests_stay_flat_while_50_checkpoints_accumulate(s3_server, monkeypatch, keep):
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/run/checkpoints"
    opts = s3_server["storage_options"]
    fs, _ = sfs.resolve(url, opts)
    calls: list = []
    listed: list = []  # the Prefix of each LIST
    per_commit: list = []
    folder_lists: list = []  # LISTs of the checkpoints folder, per commit
    real_commit = Committer.commit

    def commit(self, *a, **k):
        calls.clear()
        listed.clear()
        info = real_commit(self, *a, **k)
        folder_prefix = sfs.resolve(url, opts)[1].split("/", 1)[1].rstrip("/") + "/"
        folder_lists.append(sum(p == folder_prefix for p in listed))
        per_commit.append(collections.Counter(calls))
        return info

    monkeypatch.setattr(Committer, "commit", commit)
    _counting(fs, calls, listed)
    try:
        m = model()
        config = CheckpointConfig(
            save_folder=url, storage_options=opts, save_every_n_seconds=None, save_every_n_steps=1, keep=keep,
            async_save=False,
        )  # fmt: skip
        Trainer(
            model=m,
            train_dataloader=loader(),
            max_duration="50ba",
            optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
            checkpoint=config,
            seed=1,
        ).fit()
    finally:
        del fs._call_s3
    assert len(per_commit) == 50
    assert folder_lists[0] == 1 and folder_lists[1:] == [0] * 49  # loading the index, once
    steady = per_commit[4:]  # the first loads the index (one GET, one LIST) and marks the run dir
    assert all(c == steady[0] for c in steady), [dict(c) for c in per_commit]
    # the packed checkpoint (one PUT) and index.json (one PUT); with keep=3 also the oldest one's
    # deletion (its manifest, then s3fs's recursive rm of its own prefix): no GET of any checkpoint
    assert steady[0]["put_object"] == 2 + (keep is not None) and steady[0]["get_object"] == 0
    assert keep is not None or set(steady[0]) == {"put_object"}
    committed = list_checkpoints(url, storage_options=opts)
    assert len(committed) == (50 if keep is None else 3) and committed[-1].batch == 50


def _save(url, batch):
    return write_checkpoint(url, files={"state.pt": {"b": batch}}, timestamp={"batch": batch}, world_size=1)


def test_index_is_rebuilt_from_the_folder_when_stale_missing_or_garbled(tmp_path):
    url = str(tmp_path / "checkpoints")
    folder = CheckpointFolder(url)
    infos = [_save(url, b) for b in (1, 2, 3)]
    for info in infos[:2]:
        folder.committed(info)  # a crash after the third commit, before its index update
    assert [e.name for e in CheckpointIndex.load(url).entries] == [i.name for i in infos]
    assert latest_checkpoint(url).name == infos[-1].name
    assert load_latest_valid(url).files["state.pt"] == {"b": 3}
    sfs.delete(*sfs.resolve(url + "/" + infos[-1].name), recursive=True)  # deleted behind the index's back
    assert latest_checkpoint(url).name == infos[1].name
    (tmp_path / "checkpoints" / INDEX_FILE).write_text("{not json")
    assert [e.name for e in CheckpointIndex.load(url).entries] == [i.name for i in infos[:2]]
    (tmp_path / "checkpoints" / INDEX_FILE).unlink()
    assert latest_checkpoint(url).name == infos[1].name


def test_an_uncommitted_directory_is_a_leftover_and_pruned_below_the_newest(tmp_path):
    url = str(tmp_path / "checkpoints")
    old, new = _save(url, 1), _save(url, 5)
    (tmp_path / "checkpoints" / "ckpt-000000000003-deadbeef").mkdir()  # a crashed save
    (tmp_path / "checkpoints" / "ckpt-000000000009-deadbeef").mkdir()  # one in flight (newer)
    folder = CheckpointFolder(url)
    assert [e.name for e in folder.index.entries] == [old.name, new.name] and len(folder.index.leftovers) == 2
    deleted = folder.prune(1)
    assert sorted(sfs.basename(u) for u in deleted) == sorted([old.name, "ckpt-000000000003-deadbeef"])
    assert (tmp_path / "checkpoints" / "ckpt-000000000009-deadbeef").exists()


def test_an_index_write_killed_before_its_rename_leaves_a_temp_that_the_next_commit_deletes(tmp_path):
    """A rank 0 SIGKILLed while writing index.json (its temp written, not yet renamed: seen under load in
    tests/ray/test_resume.py's kills) leaves ``.index.json.<random>.tmp``. The next committing process's load
    sees it in the listing it makes anyway, and its first commit deletes it with the crashed saves: each kill
    no longer leaves a file in the folder for good. A reader's load deletes nothing."""
    url = str(tmp_path / "checkpoints")
    first = _save(url, 1)
    CheckpointFolder(url).committed(first)
    dead = tmp_path / "checkpoints" / f".{INDEX_FILE}.x45wzd7n.tmp"
    dead.write_text('{"version": 1, "entr')  # killed mid-write
    assert [e.name for e in CheckpointIndex.load(url).entries] == [first.name] and dead.exists()
    folder = CheckpointFolder(url)
    assert [sfs.basename(u) for u in folder.index.dead_writes] == [dead.name]
    deleted = folder.committed(_save(url, 2))
    assert [sfs.basename(u) for u in deleted] == [dead.name] and not dead.exists()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted([INDEX_FILE, first.name, folder.index.newest().name])


def test_a_delete_that_fails_during_retention_does_not_fail_the_commit(tmp_path, monkeypatch, caplog):
    """Retention runs after a commit: an outage while deleting old checkpoints is logged, and the
    checkpoint it could not delete is found again (and pruned) at the next start, not lost."""
    import raytrain_events.checkpoint.folder.folder as folder_module
    from raytrain_events.checkpoint.folder.folder import LocalRetention

    url = str(tmp_path / "checkpoints")
    folder = CheckpointFolder(url, retention=LocalRetention(keep=1))
    infos = [_save(url, 1)]
    folder.committed(infos[0])
    infos.append(_save(url, 2))

    def down(*args, **kwargs):
        raise OSError("503 SlowDown")

    monkeypatch.setattr(folder_module, "delete_checkpoint", down)
    assert folder.committed(infos[1]) == []  # nothing deleted, nothing raised
    assert "Retention could not delete" in caplog.text and infos[0].name in caplog.text
    assert latest_checkpoint(url).name == infos[1].name
    monkeypatch.undo()
    folder = CheckpointFolder(url)  # the next start: the folder still holds both
    assert [e.name for e in folder.index.entries] == [i.name for i in infos]
    assert [sfs.basename(u) for u in folder.prune(1)] == [infos[0].name]


def test_two_runs_with_sibling_save_folders_each_lock_their_own(tmp_path):
    """A ``save_folder`` not named ``checkpoints`` is its own run directory (`RunDir.of_checkpoints`): two
    runs saving to ``<dir>/a`` and ``<dir>/b`` hold their own ``running`` locks. The parent used to be
    taken for the run, so the second run was refused with the first one's lock (any folder of a bucket)."""
    from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
    from raytrain_events.storage.locks import has_lock, read_lock

    trainers = []
    for name in ("a", "b"):
        m = model()
        config = CheckpointConfig(save_folder=str(tmp_path / name), save_every_n_seconds=None)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        trainers.append(
            Trainer(model=m, train_dataloader=loader(), max_duration="1ba", optimizers=optimizer, checkpoint=config)
        )
    try:
        for name in ("a", "b"):
            assert read_lock(str(tmp_path / name), "running") is not None
        assert not has_lock(str(tmp_path))
    finally:
        for trainer in trainers:
            find_checkpointer(trainer.state).close()
    assert not has_lock(str(tmp_path / "a")) and not has_lock(str(tmp_path / "b"))


def test_keep_none_keeps_every_checkpoint_and_deletes_a_crashed_saves_leftovers_below_a_commit(tmp_path):
    """``keep=None`` keeps every committed checkpoint; a commit deletes the uncommitted directories (a crashed save:
    a replica groups' lead that died writing it) below it, not one above it (a save in flight)."""
    url = str(tmp_path / "checkpoints")
    old = _save(url, 1)
    (tmp_path / "checkpoints" / "ckpt-000000000003-deadbeef").mkdir()  # the dead lead's half-written save
    (tmp_path / "checkpoints" / "ckpt-000000000003-deadbeef" / "state.pt").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "ckpt-000000000009-deadbeef").mkdir()  # one in flight (newer)
    folder = CheckpointFolder(url)
    assert len(folder.index.leftovers) == 2
    late = _save(url, 4)
    deleted = folder.committed(late)
    assert [sfs.basename(u) for u in deleted] == ["ckpt-000000000003-deadbeef"]
    assert [e.name for e in folder.index.entries] == [old.name, late.name]
    assert (tmp_path / "checkpoints" / "ckpt-000000000009-deadbeef").exists()
