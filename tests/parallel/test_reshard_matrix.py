"""The reshard matrix through the sharded (DCP) checkpoint path: HSDP 2x2 -> FSDP 3 -> DDP 1,
FSDP x TP 2x2 -> FSDP 4 -> FSDP x TP 2x2, and HSDP x TP 2x1x2 both ways with FSDP 4 and DDP 1
(DDP 1 -> HSDP x TP; FSDP 4 -> HSDP x TP -> FSDP 4 and -> DDP 1), and context parallelism:
HSDP x TP 2x1x2 -> CP x TP 2x2 -> DDP 1. Each hop restores parameters, optimizer state and the
Timestamp exactly (atol 0); each middle hop trains a 5th batch and saves, so the next hop reads a
checkpoint written by that layout. The 4-rank hops share one spawn (tp_workloads.reshard_matrix_four).
"""

from __future__ import annotations

import torch

from raytrain_events.checkpoint import list_checkpoints
from tests.parallel.spawn import run_ranks
from tests.parallel.tp_workloads import ddp1_save_lm, hsdp_to_fsdp3, lm_trainer, reshard_matrix_four
from tests.parallel.workloads import checkpointed_trainer, snapshot


def _assert_restored(got, want, what, epoch_ended=False):
    """``epoch_ended``: ``want`` was taken after fit's last batch ended the epoch, after the save
    (the save holds the same totals, mid-epoch), so only the totals are compared."""
    for part in ("model", "optim"):
        assert got[part].keys() == want[part].keys(), f"{what} {part}"
        for key, value in want[part].items():
            torch.testing.assert_close(got[part][key], value, rtol=0, atol=0, msg=f"{what} {part} {key}")
    counters = {k: v for k, v in want["timestamp"].items() if not k.endswith("_wct")}  # wall clock is per rank
    if epoch_ended:
        counters = {k: v for k, v in counters.items() if k in ("batch", "sample", "token")}
    assert {k: got["timestamp"][k] for k in counters} == counters, what


def test_reshard_matrix(tmp_path):
    hsdp_folder, tp_folder = str(tmp_path / "hsdp"), str(tmp_path / "tp")
    ddp1_folder = str(tmp_path / "ddp1")
    ddp1_saved = ddp1_save_lm(ddp1_folder)  # DDP 1 writes the checkpoint HSDP x TP loads first
    cp_folder = str(tmp_path / "cp")
    four = run_ranks(4, reshard_matrix_four, hsdp_folder, tp_folder, ddp1_folder, cp_folder)
    assert [(c.batch, c.world_size) for c in list_checkpoints(tp_folder)] == [(2, 4), (4, 4), (5, 4), (6, 4)]
    for rank, got in enumerate(four):  # FSDP x TP 2x2 -> FSDP 4 -> FSDP x TP 2x2
        assert got["fsdp4"]["loaded"]["timestamp"]["batch"] == 4
        _assert_restored(got["fsdp4"]["loaded"], four[0]["tp_saved"], f"FSDP x TP 2x2 -> FSDP 4, rank {rank}")
        assert got["fsdp4"]["saved"]["timestamp"]["batch"] == 5
        _assert_restored(got["tp_loaded"], four[0]["fsdp4"]["saved"], f"FSDP 4 -> FSDP x TP 2x2, rank {rank}")
        assert got["tp_loaded_mesh_dims"] == [1, 2]  # loaded into the split layers' 2-D DTensors
        hops = got["hsdp_tp"]  # HSDP x TP 2x1x2: split layers are 3-D DTensors (replicate, shard, tensor)
        assert hops["mesh_dims"] == [2, 3]
        _assert_restored(hops["from_ddp1"], ddp1_saved, f"DDP 1 -> HSDP x TP 2x1x2, rank {rank}")
        _assert_restored(hops["from_fsdp4"], four[0]["fsdp4"]["saved"], f"FSDP 4 -> HSDP x TP 2x1x2, rank {rank}")
        assert hops["saved"]["timestamp"]["batch"] == 6
        _assert_restored(
            hops["fsdp4_loaded"], four[0]["hsdp_tp"]["saved"], f"HSDP x TP 2x1x2 -> FSDP 4, rank {rank}", True
        )
    back = lm_trainer(0, "ddp", "6ba", 1, tp_folder, autoresume=True)  # HSDP x TP 2x1x2 -> DDP 1
    _assert_restored(snapshot(back), four[0]["hsdp_tp"]["saved"], "HSDP x TP 2x1x2 -> DDP 1", True)
    back.close()
    for rank, got in enumerate(four):  # HSDP x TP 2x1x2 -> CP x TP 2x2 (context_parallel=2, tensor_parallel=2)
        want = four[0]["hsdp_tp"]["saved"]
        _assert_restored(got["cp_tp"]["loaded"], want, f"HSDP x TP 2x1x2 -> CP x TP 2x2, rank {rank}", True)
        assert got["cp_tp"]["saved"]["timestamp"]["batch"] == 7
    assert [(c.batch, c.world_size) for c in list_checkpoints(cp_folder)] == [(7, 4)]
    back = lm_trainer(0, "ddp", "7ba", 1, cp_folder, autoresume=True)  # CP x TP 2x2 -> DDP 1
    _assert_restored(snapshot(back), four[0]["cp_tp"]["saved"], "CP x TP 2x2 -> DDP 1")
    back.close()

    three = run_ranks(3, hsdp_to_fsdp3, hsdp_folder)  # HSDP 2x2 -> FSDP 3
    for rank, got in enumerate(three):
        assert got["loaded"]["timestamp"]["batch"] == 4
        _assert_restored(got["loaded"], four[0]["hsdp_saved"], f"HSDP 2x2 -> FSDP 3, rank {rank}")
    assert [(c.batch, c.world_size) for c in list_checkpoints(hsdp_folder)] == [(2, 4), (4, 4), (5, 3)]

    trainer = checkpointed_trainer(0, "ddp", hsdp_folder, "5ba", autoresume=True)  # FSDP 3 -> DDP 1
    _assert_restored(snapshot(trainer), three[0]["saved"], "FSDP 3 -> DDP 1")
    assert trainer.state.timestamp.batch.value == 5
    trainer.close()
