"""The reshard matrix through the sharded (DCP) checkpoint path: HSDP 2x2 -> FSDP 3 -> DDP 1, and
FSDP x TP 2x2 -> FSDP 4 -> FSDP x TP 2x2. Each hop restores parameters, optimizer state and the
Timestamp exactly (atol 0); each middle hop trains a 5th batch and saves, so the next hop reads a
checkpoint written by that layout. The 4-rank hops share one spawn (tp_workloads.reshard_matrix_four).
"""

from __future__ import annotations

import torch

from raytrain_events.checkpoint import list_checkpoints
from tests.parallel.spawn import run_ranks
from tests.parallel.tp_workloads import hsdp_to_fsdp3, reshard_matrix_four
from tests.parallel.workloads import checkpointed_trainer, snapshot


def _assert_restored(got, want, what):
    for part in ("model", "optim"):
        assert got[part].keys() == want[part].keys(), f"{what} {part}"
        for key, value in want[part].items():
            torch.testing.assert_close(got[part][key], value, rtol=0, atol=0, msg=f"{what} {part} {key}")
    counters = {k: v for k, v in want["timestamp"].items() if not k.endswith("_wct")}  # wall clock is per rank
    assert {k: got["timestamp"][k] for k in counters} == counters, what


def test_reshard_matrix(tmp_path):
    hsdp_folder, tp_folder = str(tmp_path / "hsdp"), str(tmp_path / "tp")
    four = run_ranks(4, reshard_matrix_four, hsdp_folder, tp_folder)
    assert [(c.batch, c.world_size) for c in list_checkpoints(tp_folder)] == [(2, 4), (4, 4), (5, 4)]
    for rank, got in enumerate(four):  # FSDP x TP 2x2 -> FSDP 4 -> FSDP x TP 2x2
        assert got["fsdp4"]["loaded"]["timestamp"]["batch"] == 4
        _assert_restored(got["fsdp4"]["loaded"], four[0]["tp_saved"], f"FSDP x TP 2x2 -> FSDP 4, rank {rank}")
        assert got["fsdp4"]["saved"]["timestamp"]["batch"] == 5
        _assert_restored(got["tp_loaded"], four[0]["fsdp4"]["saved"], f"FSDP 4 -> FSDP x TP 2x2, rank {rank}")
        assert got["tp_loaded_mesh_dims"] == [1, 2]  # loaded into the split layers' 2-D DTensors

    three = run_ranks(3, hsdp_to_fsdp3, hsdp_folder)  # HSDP 2x2 -> FSDP 3
    for rank, got in enumerate(three):
        assert got["loaded"]["timestamp"]["batch"] == 4
        _assert_restored(got["loaded"], four[0]["hsdp_saved"], f"HSDP 2x2 -> FSDP 3, rank {rank}")
    assert [(c.batch, c.world_size) for c in list_checkpoints(hsdp_folder)] == [(2, 4), (4, 4), (5, 3)]

    trainer = checkpointed_trainer(0, "ddp", hsdp_folder, "5ba", autoresume=True)  # FSDP 3 -> DDP 1
    _assert_restored(snapshot(trainer), three[0]["saved"], "FSDP 3 -> DDP 1")
    assert trainer.state.timestamp.batch.value == 5
    trainer.close()
