"""Sharded replica groups' live recovery (`ShardedReplicaState`): a joining group's worker gets the same position's
shards of a live group as local tensors, copies them into its own shards, and then steps exactly as the live one
(model, Adam state made DTensors again, Timestamp), with a `SpikeGuard`'s skip list and rollbacks and
`State.skipped`; and the spike guard's group norm (each worker's share, summed over the group) is the whole
model's; 2 real FSDP2 ranks on gloo, no Ray."""

from __future__ import annotations

import pytest

from tests.parallel.sharded_replica_workloads import heal_from_a_peers_shards
from tests.parallel.spawn import run_ranks


def test_a_joining_group_heals_each_position_from_a_peers_shards_and_steps_exactly_as_it():
    results = run_ranks(2, heal_from_a_peers_shards)
    for rank, got in enumerate(results):
        assert got["plain"], rank  # sent as local tensors (no DeviceMesh crosses groups)
        assert got["shard_rows"] == 8, rank  # 16 rows over 2 ranks: each position holds half
        assert all(got["same"]) and all(got["after"]), (rank, got)
        assert got["healed"] == 1 and got["timestamp"] == 3, (rank, got)
        assert all(got["spikes"]), (rank, got)  # the guard's part healed with the shards
        assert got["group_norm"] == pytest.approx(got["whole_norm"], rel=1e-6), (rank, got)
        assert got["local_sum_norm"] == pytest.approx(got["whole_norm"], rel=1e-6)  # FSDP alone: no copies


def test_fsdp_x_tp_shards_heal_by_position_at_a_real_shape():
    """Groups of 4 = 2 FSDP x 2 TP (`FSDPConfig(tensor_parallel=2)` inside a replica group): each position's shards
    are 2-D (split by TP, then by FSDP) and heal from the same position exactly, Adam state included."""
    results = run_ranks(4, heal_from_a_peers_shards, 2)
    for rank, got in enumerate(results):
        assert got["plain"], rank
        assert got["shard_rows"] == 4, rank  # the first layer's 16 outputs: / 2 (TP, colwise) / 2 (FSDP, dim 0)
        assert got["shard_cols"] == 8, rank  # the second layer's 16 inputs / 2 (TP, rowwise)
        assert all(got["same"]) and all(got["after"]), (rank, got)
        assert got["healed"] == 1 and got["timestamp"] == 3, (rank, got)
        assert all(got["spikes"]), (rank, got)
        # The second layer's bias is replicated over the tensor dimension: each copy's square counted once.
        assert got["group_norm"] == pytest.approx(got["whole_norm"], rel=1e-6), (rank, got)
        assert got["local_sum_norm"] > got["whole_norm"] * (1 + 1e-4), (rank, got)


class _NoQuorum:
    """A torchft Manager (and its collective watch) outside any quorum: a group replaced after the others ended."""

    def allreduce(self, *args):
        raise AssertionError("must call start_quorum before wait_quorum")


def test_a_sharded_load_builds_the_optimizer_state_without_a_collective_across_groups():
    """DCP's optimizer state dict steps an optimizer with no state (zero gradients, lr 0) to build it; through
    replica groups' `CommitOptimizer` that step is an all-reduce across the groups, which fails outside a quorum (a
    group replaced after the others finished loads the final checkpoint alone). The sharded checkpoint IO gives DCP
    the wrapped optimizer instead: its state is built locally, the parameters untouched."""
    import pytest
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from raytrain_events.checkpoint.dcp.sharded import state_optimizers
    from raytrain_events.ray.replica_groups import CommitOptimizer

    def build():
        model = torch.nn.Linear(4, 3)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        return model, adam, CommitOptimizer(_NoQuorum(), adam, _NoQuorum())

    model, adam, commit = build()
    with pytest.raises(AssertionError, match="start_quorum"):
        get_optimizer_state_dict(model, [commit])  # what the sharded load did before
    model, adam, commit = build()
    before = [p.detach().clone() for p in model.parameters()]
    sd = get_optimizer_state_dict(model, state_optimizers([commit]))
    assert state_optimizers([commit]) == [adam] and state_optimizers([adam]) == [adam]
    assert len(adam.state) == 2 and all(sorted(v) == ["exp_avg", "exp_avg_sq", "step"] for v in sd["state"].values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
