"""Sharded replica groups' live recovery (`ShardedReplicaState`): a joining group's worker gets the same position's
shards of a live group as local tensors, copies them into its own shards, and then steps exactly as the live one
(model, Adam state made DTensors again, Timestamp); 2 real FSDP2 ranks on gloo, no Ray."""

from __future__ import annotations

from tests.parallel.sharded_replica_workloads import heal_from_a_peers_shards
from tests.parallel.spawn import run_ranks


def test_a_joining_group_heals_each_position_from_a_peers_shards_and_steps_exactly_as_it():
    results = run_ranks(2, heal_from_a_peers_shards)
    for rank, got in enumerate(results):
        assert got["plain"], rank  # sent as local tensors (no DeviceMesh crosses groups)
        assert got["shard_rows"] == 8, rank  # 16 rows over 2 ranks: each position holds half
        assert all(got["same"]) and all(got["after"]), (rank, got)
        assert got["healed"] == 1 and got["timestamp"] == 3, (rank, got)
