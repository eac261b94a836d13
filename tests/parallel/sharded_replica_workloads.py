"""Rank functions for test_sharded_replica_state.py (importable by the spawned ranks)."""

from __future__ import annotations

import copy

import torch


def _model(seed: int, tensor_parallel: int = 1) -> torch.nn.Module:
    """FSDP2 over every rank, or FSDP x TP on a ``(world // t, t)`` mesh (the first layer split by its outputs, the
    second by its inputs, then sharded over the ``shard`` dimension), as a replica group's Trainer builds it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = None
    if tensor_parallel > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        shape = (dist.get_world_size() // tensor_parallel, tensor_parallel)
        full = init_device_mesh("cpu", shape, mesh_dim_names=("shard", "tensor"))
        parallelize_module(model, full["tensor"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = full["shard"]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, optimizer, x) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def heal_from_a_peers_shards(rank: int, world_size: int, tensor_parallel: int = 1) -> dict:
    """A live replica (model ``a``, 3 Adam steps) sends its shards; a fresh one (``b``, other weights) loads them;
    both then take the same step. Returns whether b matched a exactly, before and after. ``tensor_parallel``: FSDP x
    TP (a tensor group's ranks take the same rows)."""
    from raytrain_events.callbacks import SpikeGuard
    from raytrain_events.core.spikes import Skipped, SkipRange
    from raytrain_events.core.timestamp import Timestamp
    from raytrain_events.ray.fault_tolerance.sharded_replica_groups import ShardedReplicaState

    class LoopState:  # what the heal reads of the loop's State: a SpikeGuard's part and State.skipped too
        timestamp = Timestamp()

        def __init__(self):
            self.callbacks, self.skipped = [SpikeGuard()], Skipped()

    torch.manual_seed(100 + rank // tensor_parallel)  # each data-parallel rank its own rows, as in a group
    a = _model(0, tensor_parallel)
    opt_a = torch.optim.Adam(a.parameters(), lr=0.05)
    for _ in range(3):
        _step(a, opt_a, torch.randn(8, 6))
    norm = group_norms(a)  # the gradients of a's last step
    live = ShardedReplicaState()
    live.model, live.optimizer, live.state = a, opt_a, LoopState()
    live.state.timestamp = Timestamp(epoch=1, batch=3, sample=24)
    live.state.callbacks[0].skips.add(SkipRange(0, 8, 16, 1, 0))  # a rollback's window, before the heal
    live.state.callbacks[0].rollbacks.append({"batch": 2, "restored_batch": 1})
    live.state.skipped.add_window(1, 8, 0)
    sent = live.state_dict()
    plain = all(not hasattr(v, "to_local") for v in sent["model"].values())
    sent = copy.deepcopy(sent)  # what the transport delivers: copies, never the sender's storage
    b = _model(1, tensor_parallel)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.05)
    joining = ShardedReplicaState()
    joining.model, joining.optimizer, joining.state = b, opt_b, LoopState()
    joining.load_state_dict(sent)
    guard = joining.state.callbacks[0]
    spikes = [guard.skips.ranges == [SkipRange(0, 8, 16, 1, 0)], guard.rollbacks == [{"batch": 2, "restored_batch": 1}]]
    spikes.append(joining.state.skipped.state_dict() == live.state.skipped.state_dict())
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
        "spikes": spikes,
        **norm,
        "timestamp": int(joining.state.timestamp.batch),
        "shard_rows": a[0].weight.to_local().shape[0],
        "shard_cols": a[2].weight.to_local().shape[1],
    }


def group_norms(model) -> dict:
    """The group's gradient norm from each worker's share (`group_share_norm`, its squares summed over the group, as
    `StepVote.group_sum` does) against the whole gradients' norm (``full_tensor``), and the sum of plain local norms
    squared (which counts a parameter replicated over the tensor dimension once per copy)."""
    import torch.distributed as dist

    from raytrain_events.callbacks.spike_norm import group_share_norm

    params = list(model.parameters())
    share = group_share_norm(params)
    squares = torch.stack(
        [share.square(), torch.linalg.vector_norm(torch.stack([p.grad.to_local().norm() for p in params])).square()]
    )
    dist.all_reduce(squares)
    whole = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in params]))
    return {
        "group_norm": squares[0].sqrt().item(),
        "local_sum_norm": squares[1].sqrt().item(),
        "whole_norm": whole.item(),
    }
