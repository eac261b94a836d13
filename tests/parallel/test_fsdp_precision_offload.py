"""FSDP's mixed-precision and CPU-offload options take effect (2 gloo ranks on CPU), and SWA is refused.

bf16: the layers compute in bf16 while the kept (sharded) parameters and the optimizer stay fp32, and
training follows DDP's fp32 run closely without equalling it. CPU offload changes where the shards
live, not the arithmetic: it equals DDP to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_events.algorithms.swa import SWA
from raytrain_events.parallel.wrap import check_algorithms_for_sharding
from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import train_mixed_precision_and_offload


def _distance(a, b):
    return torch.sqrt(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a)).item()


def test_bf16_computes_in_bf16_keeps_fp32_and_cpu_offload_equals_ddp():
    for rank, got in enumerate(run_ranks(2, train_mixed_precision_and_offload)):
        assert got["ddp_compute"] == [("torch.float32", "torch.float32")]
        assert got["bf16_compute"] == [("torch.bfloat16", "torch.bfloat16")]  # every Linear, in forward
        assert got["bf16_kept"] == ["torch.float32"]  # the sharded parameters the optimizer updates
        moved = _distance(got["ddp"], got["initial"])
        off = _distance(got["bf16"], got["ddp"])
        assert 0 < off < 0.1 * moved, (rank, off, moved)  # bf16 rounding changed the run, only slightly
        assert got["offload_compute"] == [("torch.float32", "torch.float32")]
        assert got["offload_devices"] == ["cpu"]
        for key, want in got["ddp"].items():
            torch.testing.assert_close(got["offload"][key], want, rtol=0, atol=1e-5, msg=f"offload {key} rank {rank}")


def test_swa_is_refused_under_fsdp_with_the_reason_and_the_fix():
    with pytest.raises(ValueError, match="cannot run with parallelism='fsdp'") as info:
        check_algorithms_for_sharding([SWA()])
    assert "AveragedModel" in str(info.value) and "use EMA" in str(info.value)
