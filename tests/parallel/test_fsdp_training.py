"""FSDP2 training matches DDP training of the same model and data (gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import train_ddp_and_fsdp


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_matches_ddp_with_grad_accum_and_clipping(world_size):
    results = run_ranks(world_size, train_ddp_and_fsdp, "6ba")
    initial = None
    for rank, got in enumerate(results):
        assert not got["ddp_sharded"] and got["fsdp_sharded"] and got["fsdp_root_sharded"]
        assert got["ddp_norm"] > 0.1  # clipping was active (the threshold is 0.1)
        for name in ("fsdp", "fsdp_root"):
            assert got[name + "_norm"] == pytest.approx(got["ddp_norm"], rel=1e-5)
            assert got[name].keys() == got["ddp"].keys()
            for key, ddp_value in got["ddp"].items():
                torch.testing.assert_close(
                    got[name][key], ddp_value, rtol=0, atol=1e-5, msg=f"{name} {key} rank {rank}"
                )
        if initial is None:
            initial = got["ddp"]
        for key, value in got["ddp"].items():  # every rank ends with the same weights
            torch.testing.assert_close(value, initial[key], rtol=0, atol=0)
