"""FSDP2 training matches DDP training of the same model and data (gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import train_ddp_and_fsdp


@pytest.mark.parametrize(
    "world_size, arms",
    [
        (2, ["ddp", "fsdp", "fsdp_root", "fsdp_ac", "ddp_freeze", "fsdp_freeze"]),
        (3, ["ddp", "fsdp", "fsdp_root"]),
        (2, ["ddp", "hsdp"]),  # HSDP 2x1: replicate over both ranks
    ],
)
def test_fsdp_matches_ddp_with_grad_accum_and_clipping(world_size, arms):
    _check_matches_ddp(world_size, arms)


def test_hsdp_and_tensor_parallel_meshes_on_four_ranks_match_ddp():
    """HSDP 2x2, and FSDP x TP 2x2 on the example transformer against DDP with the same global batches
    and HSDP x TP 2x1x2 (a (replicate, shard, tensor) mesh) against the same DDP reference. Four
    spawned ranks on multi-dimensional meshes: the end-to-end tier (tests/e2e.py), ~8 s here."""
    _check_matches_ddp(4, ["ddp", "hsdp", "lm_ddp2", "lm_tp", "lm_hsdp_tp"])


def _check_matches_ddp(world_size, arms):
    results = run_ranks(world_size, train_ddp_and_fsdp, "6ba", arms)
    initial = None
    for rank, got in enumerate(results):
        for name in arms:
            if name.startswith("lm_"):  # mesh dims of the DTensor parameters: split layers 2-D, the rest 1-D
                assert got[name + "_sharded"] == {"lm_tp": [1, 2], "lm_hsdp_tp": [2, 3]}.get(name, []), name
            else:
                assert got[name + "_sharded"] == name.startswith(("fsdp", "hsdp")), name
            reference = "ddp_freeze" if name.endswith("_freeze") else "lm_ddp2" if name.startswith("lm_") else "ddp"
            assert got[reference + "_norm"] > 0.1  # clipping was active (the threshold is 0.1)
            assert got[name + "_norm"] == pytest.approx(got[reference + "_norm"], rel=1e-5), name
            assert got[name].keys() == got[reference].keys()
            for key, want in got[reference].items():
                torch.testing.assert_close(got[name][key], want, rtol=0, atol=1e-5, msg=f"{name} {key} rank {rank}")
        if "fsdp_freeze" in arms:  # LayerFreezing froze layers, and eval metrics are global, under both
            assert got["fsdp_freeze_frozen"] == got["ddp_freeze_frozen"] > 0
            assert got["fsdp_freeze_eval"] == pytest.approx(got["ddp_freeze_eval"], rel=1e-5)
            assert got["fsdp_freeze_eval"] == pytest.approx(results[0]["fsdp_freeze_eval"], rel=1e-6)
        if "lm_tp" in arms:  # one rank per tensor group counts the group's batch: 5 batches x 8 x 2 groups
            assert got["lm_tp_samples"] == got["lm_hsdp_tp_samples"] == 80 and got["lm_ddp2_samples"] == 160
        if initial is None:
            initial = got["ddp"]
        for key, value in got["ddp"].items():  # every rank ends with the same weights
            torch.testing.assert_close(value, initial[key], rtol=0, atol=0)


def test_hsdp_mesh_shape_and_bad_splits():
    from raytrain_events.parallel import FSDPConfig

    assert FSDPConfig().mesh_shape(4) == (4,)
    assert FSDPConfig(replicate=2).mesh_shape(8) == (2, 4)
    with pytest.raises(ValueError, match=r"replicate=2\) needs a world size divisible by 2, got 3"):
        FSDPConfig(replicate=2).mesh_shape(3)
    with pytest.raises(ValueError, match="replicate=0 must be an integer >= 1"):
        FSDPConfig(replicate=0)
