"""A crafted sharded checkpoint cannot run code: its .metadata and byte items are refused.

Each payload would create a marker file when unpickled. The test first shows that stock DCP
runs it (so the payload is real), then that our loader refuses it and nothing ran. Also: the
consolidated export of a sharded checkpoint.
"""

from __future__ import annotations

import os
import pickle
import zlib

import pytest
import torch

from raytrain_events.checkpoint import CheckpointConfig, UnsafeCheckpointError, latest_checkpoint
from tests.parallel.workloads import make_trainer


class RunsCode:
    """Unpickling this runs a shell command (``touch <marker>``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _sharded_checkpoint(folder: str):
    """A real sharded checkpoint of one process (DCP without a process group)."""
    trainer = make_trainer(0, "fsdp", "2ba", checkpoint=_config(folder, autoresume=False))
    trainer.fit()
    return latest_checkpoint(folder)


def _config(folder: str, autoresume: bool = True) -> CheckpointConfig:
    return CheckpointConfig(
        save_folder=folder, sharded=True, autoresume=autoresume, lock_run_dir=False, save_every_n_seconds=None
    )


def test_crafted_metadata_is_refused_and_nothing_runs(tmp_path):
    info = _sharded_checkpoint(str(tmp_path / "ckpts"))
    marker = tmp_path / "pwned-metadata"
    with open(os.path.join(info.url, ".metadata"), "wb") as f:
        pickle.dump(RunsCode(str(marker)), f)

    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(AttributeError):  # stock DCP: plain pickle.load runs it, then fails on the result
        FileSystemReader(info.url).read_metadata()
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match="not one of DCP's metadata classes"):
        make_trainer(0, "fsdp", "2ba", checkpoint=_config(str(tmp_path / "ckpts")))
    assert not marker.exists()


def test_crafted_byte_item_is_refused_and_nothing_runs(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    info = _sharded_checkpoint(str(tmp_path / "ckpts"))
    marker = tmp_path / "pwned-bytes"
    victim = make_trainer(0, "fsdp", "2ba")
    model_sd, optim_sd = get_state_dict(victim.state.model, victim.state.optimizers)
    optim_sd["param_groups"][0]["lr"] = RunsCode(str(marker))  # a non-tensor item: DCP stores it as bytes
    for name in os.listdir(info.url):
        if name == ".metadata" or name.endswith(".distcp"):
            os.remove(os.path.join(info.url, name))
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": {}}, checkpoint_id=info.url, no_dist=True)
    _reseal_manifest(info.url)  # as a crafter would: the manifest's checks pass, the pickle must not

    target = {"optim": {"param_groups": [{"lr": None}]}}
    dcp.load(target, checkpoint_id=info.url, no_dist=True)  # stock DCP: torch.load(weights_only=False) runs it
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match="optim.param_groups.0.lr"):
        make_trainer(0, "fsdp", "2ba", checkpoint=_config(str(tmp_path / "ckpts")))
    assert not marker.exists()


def _reseal_manifest(url: str) -> None:
    """Rewrite the manifest's size and crc32 of every file to the files' current ones."""
    import json

    from raytrain_events.checkpoint.format.checksums import checksum

    path = os.path.join(url, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        with open(os.path.join(url, entry["name"]), "rb") as f:
            data = f.read()
        entry["size"], entry["crc32"] = len(data), checksum("crc32", data)
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_export_consolidates_a_sharded_checkpoint(tmp_path):
    from raytrain_events.cli.main import main

    folder = str(tmp_path / "ckpts")
    trainer = make_trainer(0, "fsdp", "2ba", checkpoint=_config(folder, autoresume=False))
    trainer.fit()
    assert latest_checkpoint(folder).metadata["layout"] == "dcp"
    out = tmp_path / "export" / "state.pt"
    assert main(["export", folder, str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    model = trainer.state.model.state_dict()
    assert exported["model"].keys() == model.keys()
    for key, value in model.items():
        torch.testing.assert_close(exported["model"][key], value, rtol=0, atol=0)
    assert exported["timestamp"]["batch"] == 2 and exported["optim"]["state"]
    assert main(["export", folder, str(tmp_path / "weights.pt"), "--model-only"]) == 0
    assert set(torch.load(tmp_path / "weights.pt", weights_only=True)) == {"model"}


def test_every_shard_file_is_in_the_manifest_with_its_size_and_crc32(tmp_path):
    """The DCP writer's streams count and CRC32 what they write: the manifest's record of each
    file (shards, .metadata, rank files) matches the bytes on disk, read back here."""
    info = _sharded_checkpoint(str(tmp_path / "ckpts"))
    on_disk = sorted(n for n in os.listdir(info.url) if n != "manifest.json")
    assert sorted(f.name for f in info.files) == on_disk and ".metadata" in on_disk
    assert info.format_version == 4 and any(n.endswith(".distcp") for n in on_disk)
    for f in info.files:
        with open(os.path.join(info.url, f.name), "rb") as fh:
            data = fh.read()
        assert (f.size, f.checksum) == (len(data), ("crc32", f"{zlib.crc32(data):08x}")), f.name
