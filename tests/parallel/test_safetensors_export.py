"""``raytrain-events export --format safetensors``: bit-exact, streamed one tensor at a time, and
loaded back into sharded (FSDP 3, built on meta) and unsharded models."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from raytrain_events.checkpoint import list_checkpoints
from raytrain_events.cli.main import main
from tests.parallel.alloc import PeakStorageBytes
from tests.parallel.safetensors_workloads import load_export, save_wide, start_from_export, wide_sizes
from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import train_and_save

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp_st") / "checkpoints")
    results = run_ranks(2, train_and_save, {"shard_modules": ["Block"]}, folder)
    return folder, results[0]["model"]


def test_export_round_trips_bit_exactly_into_fsdp3_and_one_process(fsdp_run, tmp_path):
    folder, saved = fsdp_run
    out = tmp_path / "st"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "toy", "hidden_size": 16}))
    assert main(["export", folder, str(out), "--format", "safetensors", "--hf-config", str(config), "--json"]) == 0
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16
    exported = safetensors_torch.load_file(str(out / "model.safetensors"))  # the reference reader agrees
    assert exported.keys() == saved.keys()
    for key, want in saved.items():
        assert exported[key].dtype == want.dtype
        torch.testing.assert_close(exported[key], want, rtol=0, atol=0, msg=key)
    # back into FSDP on 3 ranks (uneven shards), the model built on the meta device: no full copy
    for rank, got in enumerate(run_ranks(3, load_export, str(out), {"shard_modules": ["Block"]}, True)):
        assert got["sharded"] and sorted(got["loaded"]) == sorted(saved)
        for key, want in saved.items():
            torch.testing.assert_close(got["state"][key], want, rtol=0, atol=0, msg=f"rank {rank} {key}")
    got = load_export(0, 1, str(out), "ddp", False)
    for key, want in saved.items():
        torch.testing.assert_close(got["state"][key], want, rtol=0, atol=0, msg=key)


def test_export_splits_files_with_an_index(fsdp_run, tmp_path):
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors, load_safetensors
    from tests.parallel.workloads import make_model

    folder, saved = fsdp_run
    info = list_checkpoints(folder)[-1]
    summary = export_safetensors(info, str(tmp_path / "split"), max_shard_bytes=1200)
    assert len(summary["files"]) > 1
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(saved)
    model = make_model()
    load_safetensors(model, str(tmp_path / "split"))
    for key, want in saved.items():
        torch.testing.assert_close(model.state_dict()[key], want, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_safetensors(model, str(tmp_path))


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("wide") / "checkpoints")
    return folder, run_ranks(2, save_wide, folder)[0]


def test_export_peak_memory_is_one_tensor(wide_run, tmp_path, monkeypatch):
    """Allocation counting: tensors made by ops (dispatch mode), tensors torch.load makes from the
    checkpoint's blocks (counted as they come back), Python bytes read from the files (tracemalloc).
    Two ranks saved each tensor in two dim-0 blocks; each block's raw bytes go from the shard file
    to the output through one reused buffer (no tensor is built), so the peak is one block's buffer:
    bounded at one tensor (the issue's goal) plus 64 KiB of bookkeeping (index, headers)."""
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors

    folder, full = wide_run
    info = list_checkpoints(folder)[-1]
    largest = max(t.numel() * t.element_size() for t in full.values())
    total = sum(t.numel() * t.element_size() for t in full.values())
    counter = PeakStorageBytes()
    original_load = torch.load

    def counted_load(*args, **kwargs):
        out = original_load(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            counter._track(out)
        return out

    with PeakStorageBytes():  # first-time imports (the export's and the mode's) are not the export's memory
        export_safetensors(info, str(tmp_path / "warm"))
    monkeypatch.setattr(torch, "load", counted_load)
    tracemalloc.start()
    try:
        with counter:
            export_safetensors(info, str(tmp_path / "st"))
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = largest + 64 * 1024  # see above
    assert counter.peak <= 1024  # no tensor of the model's is built
    assert counter.peak + python_peak <= bound, (counter.peak, python_peak, largest, total)
    assert bound < 0.6 * total
    exported = safetensors_torch.load_file(str(tmp_path / "st" / "model.safetensors"))
    for key, want in full.items():
        torch.testing.assert_close(exported[key], want, rtol=0, atol=0)


def test_load_from_a_safetensors_directory_fills_fsdp_built_on_meta_without_a_full_copy(wide_run, tmp_path):
    """``CheckpointConfig(load_from=<export>)``: FSDP on 2 ranks, the model built on the meta device;
    each rank's peak tensor storage during set-up is its share plus one layer (the deferred init's
    bound; measured 800,852 B of a 1,057,812 B model), and the starting parameters are the exported ones bit for bit."""
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors

    folder, full = wide_run
    out = str(tmp_path / "st")
    export_safetensors(list_checkpoints(folder)[-1], out)
    sizes = wide_sizes(2)
    # + 16 KiB: the loop's and the checkpointer's RNG snapshots (torch's CPU RNG state is 5 KB each)
    bound = sizes["share"] + sizes["layer"] + 16 * 1024
    assert bound < 0.8 * sizes["model"]
    for rank, got in enumerate(run_ranks(2, start_from_export, out, str(tmp_path / "run" / "checkpoints"))):
        assert got["peak"] <= bound, (rank, got["peak"], sizes)
        assert got["start"].keys() == full.keys()
        for key, want in full.items():
            torch.testing.assert_close(got["start"][key], want, rtol=0, atol=0, msg=f"rank {rank} {key}")
        assert got["timestamp"]["batch"] == 0 and got["batches"] == 1  # weights only: a fresh Timestamp


def test_load_from_a_safetensors_directory_refuses_ignore_keys(fsdp_run, tmp_path):
    from raytrain_events import Trainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors
    from tests.parallel.workloads import make_loader, make_model

    export_safetensors(list_checkpoints(fsdp_run[0])[-1], str(tmp_path / "st"))
    model = make_model()
    config = CheckpointConfig(
        load_from=str(tmp_path / "st"), load_ignore_keys=["model/module.3.*"], save_folder=str(tmp_path / "c")
    )
    with pytest.raises(ValueError, match="load_ignore_keys.*safetensors.*Fix"):
        Trainer(
            model=model,
            train_dataloader=make_loader(0),
            max_duration="1ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            checkpoint=config,
        )


def test_an_eval_only_trainer_loads_a_safetensors_directory(fsdp_run, tmp_path):
    from raytrain_events import Trainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors
    from tests.parallel.workloads import make_loader, make_model

    folder, saved = fsdp_run
    export_safetensors(list_checkpoints(folder)[-1], str(tmp_path / "st"))
    torch.manual_seed(123)
    model = make_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # unlike the exported weights
    trainer = Trainer(
        model=model, eval_dataloader=make_loader(0), checkpoint=CheckpointConfig(load_from=str(tmp_path / "st"))
    )
    for key, want in saved.items():
        torch.testing.assert_close(trainer.state.model.state_dict()[key], want, rtol=0, atol=0, msg=key)
    assert trainer.eval()  # and it evaluates


def test_export_refuses_unknown_format(fsdp_run, tmp_path):
    from raytrain_events.cli.export import export_checkpoint

    with pytest.raises(ValueError, match="'npz' is not supported"):
        export_checkpoint(fsdp_run[0], str(tmp_path / "x"), fmt="npz")
