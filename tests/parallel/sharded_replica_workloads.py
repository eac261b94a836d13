"""Rank functions for test_sharded_replica_state.py (importable by the spawned ranks)."""

from __future__ import annotations

import copy

import torch


def _model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _step(model, optimizer, x) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def heal_from_a_peers_shards(rank: int, world_size: int) -> dict:
    """A live replica (model ``a``, 3 Adam steps) sends its shards; a fresh one (``b``, other weights) loads them;
    both then take the same step. Returns whether b matched a exactly, before and after."""
    from raytrain_events.core.timestamp import Timestamp
    from raytrain_events.ray.fault_tolerance.sharded_replica_groups import ShardedReplicaState

    class LoopState:
        timestamp = Timestamp()

    torch.manual_seed(100 + rank)  # each rank its own rows, as in a group
    a = _model(0)
    opt_a = torch.optim.Adam(a.parameters(), lr=0.05)
    for _ in range(3):
        _step(a, opt_a, torch.randn(8, 6))
    live = ShardedReplicaState()
    live.model, live.optimizer, live.state = a, opt_a, LoopState()
    live.state.timestamp = Timestamp(epoch=1, batch=3, sample=24)
    sent = live.state_dict()
    plain = all(not hasattr(v, "to_local") for v in sent["model"].values())
    sent = copy.deepcopy(sent)  # what the transport delivers: copies, never the sender's storage
    b = _model(1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.05)
    joining = ShardedReplicaState()
    joining.model, joining.optimizer, joining.state = b, opt_b, LoopState()
    joining.load_state_dict(sent)
    same = [torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters())]
    x = torch.randn(8, 6)
    _step(a, opt_a, x)
    _step(b, opt_b, x)
    after = [torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters())]
    return {
        "plain": plain,
        "same": same,
        "after": after,
        "healed": joining.healed,
        "timestamp": int(joining.state.timestamp.batch),
        "shard_rows": a[0].weight.to_local().shape[0],
    }
