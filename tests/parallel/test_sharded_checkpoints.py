"""Sharded (DCP) checkpoints: resharding N -> M ranks, DDP <-> FSDP, crash mid-save, export."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain_events.checkpoint import list_checkpoints
from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import ddp_save_then_fsdp_load, load_only, save_then_crash, train_and_save


def _assert_same(got, want, what):
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{what}: {key}")


def _assert_resumed(loaded, saved, what):
    _assert_same(loaded["model"], saved["model"], what + " model")
    _assert_same(loaded["optim"], saved["optim"], what + " optimizer")
    _assert_same(loaded["ema"], saved["ema"], what + " EMA")
    counters = {k: v for k, v in saved["timestamp"].items() if not k.endswith("_wct")}  # wall clock is per rank
    assert {k: loaded["timestamp"][k] for k in counters} == counters, what


@pytest.fixture(scope="module")
def fsdp_two_rank_run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp2") / "checkpoints")
    results = run_ranks(2, train_and_save, {"shard_modules": ["Block"]}, folder)
    return folder, results[0]


def test_fsdp_checkpoint_is_sharded_and_committed(fsdp_two_rank_run):
    folder, _ = fsdp_two_rank_run
    checkpoints = list_checkpoints(folder)
    assert [c.batch for c in checkpoints] == [3, 5]
    info = checkpoints[-1]
    assert info.metadata["layout"] == "dcp" and info.world_size == 2
    names = {f.name for f in info.files}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt", "rng-rank0.pt", "rng-rank1.pt"} <= names
    for entry in info.files:  # the manifest's sizes are the files' sizes
        assert os.path.getsize(os.path.join(info.url, entry.name)) == entry.size


def test_saved_at_two_ranks_loads_at_one(fsdp_two_rank_run):
    import torch.distributed as dist

    assert not dist.is_initialized()
    folder, saved = fsdp_two_rank_run
    loaded = load_only(0, 1, "fsdp", folder)
    assert loaded["loaded"] == list_checkpoints(folder)[-1].name
    _assert_resumed(loaded, saved, "2 -> 1")


def test_saved_at_two_ranks_loads_at_three_fsdp_and_ddp(fsdp_two_rank_run):
    folder, saved = fsdp_two_rank_run
    fsdp = run_ranks(3, load_only, {"shard_modules": ["Block"]}, folder)
    for rank, loaded in enumerate(fsdp):
        assert loaded["ema_sharded"]
        _assert_resumed(loaded, saved, f"FSDP 2 -> FSDP 3, rank {rank}")
    ddp = run_ranks(3, load_only, "ddp", folder)
    for rank, loaded in enumerate(ddp):
        _assert_resumed(loaded, saved, f"FSDP 2 -> DDP 3, rank {rank}")


def test_ddp_checkpoint_loads_into_fsdp(tmp_path):
    results = run_ranks(2, ddp_save_then_fsdp_load, str(tmp_path / "checkpoints"))
    for rank, got in enumerate(results):
        layouts = {c.batch: c.metadata.get("layout") for c in list_checkpoints(str(tmp_path / "checkpoints"))}
        assert layouts == {3: None, 5: None, 6: "dcp"}  # DDP's full checkpoints, then the FSDP run's
        _assert_resumed(got["loaded"], got["saved"], f"DDP 2 -> FSDP 2, rank {rank}")
        assert got["continued_batch"] == 6 and got["continued_ema_sharded"]  # trains on, EMA on shards


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    folder = str(tmp_path / "checkpoints")
    errors = run_ranks(2, save_then_crash, folder)
    assert all(e.startswith("CheckpointError") and "rank 1: OSError: disk full (injected)" in e for e in errors), errors
    assert [c.batch for c in list_checkpoints(folder)] == [3]
    leftovers = [d for d in os.listdir(folder) if d.startswith("ckpt-000000000005")]
    assert leftovers and not os.path.exists(os.path.join(folder, leftovers[0], "manifest.json"))
    loaded = load_only(0, 1, "fsdp", folder)
    assert loaded["timestamp"]["batch"] == 3 and loaded["loaded"].startswith("ckpt-000000000003")


def test_an_eval_only_trainer_loads_an_fsdp_checkpoint_in_one_process(fsdp_two_rank_run):
    """Asynchronous validation's load (ray/checkpointing/validate_checkpoint.py): an FSDP 2 checkpoint, resharded into the
    validator's world of one process through ``CheckpointConfig(load_from=...)``, holds the saved weights;
    the checkpoint's Timestamp comes from its manifest (a sharded load for eval restores weights only)."""
    from raytrain_events import Trainer
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.checkpoint.format.reader import read_manifest
    from raytrain_events.dist import LocalDist
    from tests.parallel.workloads import make_loader, make_model

    folder, saved = fsdp_two_rank_run
    newest = list_checkpoints(folder)[-1]
    trainer = Trainer(
        model=make_model(),
        eval_dataloader=make_loader(0),
        dist=LocalDist(torch.device("cpu")),
        checkpoint=CheckpointConfig(load_from=newest.url),
    )
    _assert_same({k: v.detach() for k, v in trainer.state.model.state_dict().items()}, saved["model"], "FSDP 2 -> 1")
    assert 0.0 <= float(trainer.eval()["metrics/eval/accuracy"]) <= 1.0
    trainer.close()
    assert read_manifest(newest.url).timestamp["batch"] == 5
