"""The node-local checkpoint tier (``CheckpointConfig(local_dir=...)``) through the Trainer on the local S3 server.

A whole-run restart reads no byte of model state from object storage while the local copy is intact, and
falls back to storage, exactly, when the copy is missing or corrupt. S3 reads are counted per object
key at s3fs's one API entry (``tests/parallel/io_count.count_s3_reads``). The sharded (DCP) case, with
ranks on their own "nodes" and one moved, is in ``tests/parallel/test_sharded_load_cost.py``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from raytrain_events import Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.folder.local_tier import LocalTier
from raytrain_events.checkpoint.folder.store import list_checkpoints
from raytrain_events.checkpoint.run.checkpointer import STATE_FILE
from raytrain_events.models import ClassifierModel
from tests.checkpoint.test_trainer_checkpoints import D, loader
from tests.checkpoint.test_trainer_checkpoints import model as small_model
from tests.parallel.io_count import count_s3_reads, payload_bytes

BIG = 2048  # a 2048 x 2048 float32 layer (16 MiB) plus a second one: state.pt is over packing's 32 MiB


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.table = torch.nn.Linear(BIG, BIG)  # trained: its momentum is saved too
        self.probe = torch.nn.Parameter(torch.zeros(BIG))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + 1e-3 * self.table(self.probe).sum()


def _trainer(folder, options, local_dir, *, duration="2ep", wide=True, **ckpt):
    torch.manual_seed(0)
    m = ClassifierModel(_Wide(), num_classes=2) if wide else small_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    config = CheckpointConfig(
        save_folder=folder,
        storage_options=options,
        save_every_n_seconds=None,
        save_interval="1ep",
        keep=1,
        local_dir=local_dir,
        **ckpt,
    )
    return Trainer(model=m, train_dataloader=loader(), max_duration=duration, optimizers=opt, checkpoint=config, seed=1)


def _params(trainer):
    return {k: v.clone() for k, v in trainer.state.model.state_dict().items()}


def _resume(folder, options, local_dir):
    with count_s3_reads() as counts:
        resumed = _trainer(folder, options, local_dir, duration="3ep", autoresume=True)
    resumed._checkpointer.close()
    return resumed, counts


def test_restart_reads_model_state_from_the_local_tier_and_falls_back_to_storage_exactly(s3_server, tmp_path):
    options = s3_server["storage_options"]
    folder = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/run/checkpoints"
    local_dir = str(tmp_path / "nvme")
    first = _trainer(folder, options, local_dir)
    first.fit()
    expected, at = _params(first), first.state.timestamp.state_dict()
    (newest,) = list_checkpoints(folder, storage_options=options)  # keep=1
    state_size = next(f.size for f in newest.files if f.name == STATE_FILE)
    assert state_size > 32 * 2**20  # a multi-file checkpoint: state.pt is its own object

    tier = LocalTier(local_dir, folder, keep=1)
    assert sorted(os.listdir(tier.root)) == [newest.name]  # bounded like storage (keep=1): epoch 1's is gone
    copy = os.path.join(tier.root, newest.name)
    assert os.path.getsize(os.path.join(copy, STATE_FILE)) == state_size

    # Intact: nothing of the model state comes from object storage, and the state is the saved one.
    resumed, counts = _resume(folder, options, local_dir)
    assert payload_bytes(counts) == 0, counts
    assert resumed.state.timestamp.state_dict() == at
    for name, value in _params(resumed).items():
        assert torch.equal(value, expected[name]), name

    # Corrupt (one byte flipped in the middle): state.pt is read from storage, whole, and loads the same.
    path = os.path.join(copy, STATE_FILE)
    with open(path, "r+b") as f:
        f.seek(state_size // 2)
        byte = f.read(1)
        f.seek(state_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed, counts = _resume(folder, options, local_dir)
    assert counts[STATE_FILE] == state_size and payload_bytes(counts) == state_size, counts
    assert resumed.state.timestamp.state_dict() == at
    for name, value in _params(resumed).items():
        assert torch.equal(value, expected[name]), name

    # Missing (the node's copy deleted, or a rank placed on another node): storage, exactly, again.
    for name in os.listdir(copy):
        os.remove(os.path.join(copy, name))
    resumed, counts = _resume(folder, options, local_dir)
    assert counts[STATE_FILE] == state_size, counts
    for name, value in _params(resumed).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize(
    "local_dir, problem",
    [
        ("s3://bucket/local", "not a local path"),
        ("{file}/x", "is a file, not a directory"),
        ("/proc/raytrain-local-tier", "not writable"),  # a mount nobody writes, root included
    ],
)
def test_a_local_dir_that_cannot_hold_copies_is_refused_naming_the_fix(tmp_path, local_dir, problem):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=problem) as err:
        CheckpointConfig(local_dir=local_dir.format(file=tmp_path / "file"))
    assert "Fix: pass a node-local directory" in str(err.value)


def test_local_keep_follows_keep(tmp_path):
    local = str(tmp_path / "local")  # a path of this test's own (a fixed /tmp path may be anything here)
    assert CheckpointConfig(local_dir=local, keep=3).local_keep == 3
    assert CheckpointConfig(local_dir=local, keep_best=2, metric="metrics/eval/acc").local_keep == 1
    assert CheckpointConfig(local_dir=local).local_keep is None
    assert CheckpointConfig(local_dir=local, keep=3, local_keep=1).local_keep == 1
    with pytest.raises(ValueError, match="local_keep=0"):
        CheckpointConfig(local_dir=local, local_keep=0)


def test_a_full_local_disk_never_fails_the_save(tmp_path, monkeypatch, caplog):
    """The local copy is best effort: a local write that fails (disk full) drops the copy with a warning; the
    upload commits, and the restart reads that file from storage."""
    import errno

    from raytrain_events.checkpoint.format import local_copy

    class Full:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            return False

    folder, local_dir = str(tmp_path / "store" / "run" / "checkpoints"), str(tmp_path / "nvme")
    with monkeypatch.context() as m:
        m.setattr(local_copy, "local_atomic_writer", Full)
        caplog.set_level("WARNING", logger=local_copy.__name__)
        first = _trainer(folder, {}, local_dir, duration="1ep", wide=False)
        first.fit()
    assert "No space left on device" in caplog.text and "a restart reads it from storage" in caplog.text
    (saved,) = list_checkpoints(folder)
    assert not os.path.exists(os.path.join(LocalTier(local_dir, folder, keep=1).root, saved.name, STATE_FILE))
    resumed = _trainer(folder, {}, local_dir, duration="3ep", wide=False, autoresume=True)
    resumed._checkpointer.close()
    assert resumed._checkpointer.loaded_local.storage[STATE_FILE] == "no local copy"
    for name, value in _params(resumed).items():
        assert torch.equal(value, _params(first)[name]), name
