"""Tensor parallelism (TP): split each layer's matrices over a group of ranks, through DTensor's
``parallelize_module``, before FSDP shards what is left over the data-parallel dimension.

The model says how to split itself: every submodule with a ``tensor_parallel_plan(degree)``
method returns ``{relative submodule name: style}`` for its own children, where a style is
``"colwise"`` (``ColwiseParallel``: the output features are split, the input is replicated),
``"rowwise"`` (``RowwiseParallel``: the input features are split, the outputs are summed over the
group), or any ``torch.distributed.tensor.parallel.ParallelStyle``. The usual plan (Megatron's)
for a transformer block is::

    def tensor_parallel_plan(self, degree):
        if self.heads % degree:
            raise ValueError(f"{self.heads} heads cannot be split over {degree} ranks")
        return {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
                "mlp.fc": "colwise", "mlp.proj": "rowwise"}

so attention runs on ``heads / degree`` heads per rank (the forward must reshape with ``-1``
heads, not the global count) and each block costs two all-reduces of the activations in forward
and two in backward, over the tensor group only. Every split dimension must be divisible by the
degree (checked here, naming the layer). Layers the plan does not name (embeddings, norms, the
head) stay whole within the group and are sharded by FSDP only.

The ranks of a tensor group compute one model replica together, so they must see the same batch;
nothing in DTensor notices if they do not (a replicated input is trusted). `check_first_batch_agrees`
compares a checksum of the first forward's inputs across the group once and refuses a mismatch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from raytrain_events._torch_compat import flatten_mesh, tree_flatten
from raytrain_events.parallel.context_parallel import METRIC_GROUPS

__all__ = [
    "PLAN_METHOD",
    "apply_tensor_parallel",
    "check_first_batch_agrees",
    "metric_group",
    "tensor_parallel_plans",
]

PLAN_METHOD = "tensor_parallel_plan"
_SPLIT_DIM = {"colwise": ("out_features", "output features"), "rowwise": ("in_features", "input features")}


def metric_group(model: torch.nn.Module) -> Any:
    """The process group metrics of a tensor-parallel ``model`` sync over (None when not tensor-parallel).

    The ranks of a tensor group see the same batches, so a metric synced over every rank would count
    each batch ``degree`` times (a sum or a count; a mean hides it). Syncing over the ranks with this
    rank's tensor coordinate -- the mesh's ``shard`` dimension, one rank per group -- counts each once.
    Under HSDP x TP that is ``(replicate, shard)`` flattened into one group (made once, on first use,
    by every rank: evaluation runs on all of them).
    """

    if model in METRIC_GROUPS:  # context parallelism (with or without TP): its data-parallel group
        return METRIC_GROUPS[model]
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)  # DTensor parameters only (layers outside the plan: 1-D)
        if mesh is not None and mesh.mesh_dim_names is not None and "tensor" in mesh.mesh_dim_names:
            if "replicate" not in mesh.mesh_dim_names:
                return mesh["shard"].get_group()

            return flatten_mesh(mesh["replicate", "shard"], "replicate_shard").get_group()
    return None


def _style(name: str, value: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(value, ParallelStyle):
        return value
    if value == "colwise":
        return ColwiseParallel()
    if value == "rowwise":
        return RowwiseParallel()
    raise ValueError(
        f"tensor_parallel_plan entry {name!r}: {value!r} is not a style. Fix: use 'colwise', 'rowwise' or a "
        "torch.distributed.tensor.parallel.ParallelStyle."
    )


def _check_entry(owner: str, module: torch.nn.Module, name: str, value: Any, degree: int) -> None:
    try:
        target = module.get_submodule(name)
    except AttributeError:
        children = sorted(n for n, _ in module.named_modules() if n)
        raise ValueError(
            f"{owner}.tensor_parallel_plan names {name!r}, which is not a submodule of it; its submodules are "
            f"{children}. Fix: use names relative to the module that returns the plan."
        ) from None
    if value in _SPLIT_DIM:
        if not isinstance(target, torch.nn.Linear):
            raise ValueError(
                f"{owner}.tensor_parallel_plan: {name!r} is a {type(target).__name__}; the {value!r} style splits "
                "torch.nn.Linear layers only. Fix: pass a ParallelStyle for it, or leave it out of the plan."
            )
        attr, words = _SPLIT_DIM[value]
        size = getattr(target, attr)
        if size % degree:
            raise ValueError(
                f"{owner}.{name} has {size} {words}, which {degree} tensor-parallel ranks cannot split evenly. "
                f"Fix: a width (and head count) divisible by {degree}, or another tensor_parallel."
            )


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, degree: int) -> List[str]:
    """Split ``model`` in place over the 1-D ``tp_mesh`` by each submodule's plan; returns the
    names of the submodules whose plan was applied. Refuses a model that has no plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    planned = tensor_parallel_plans(model, degree)
    for _, module, plan in planned:
        parallelize_module(module, tp_mesh, {name: _style(name, value) for name, value in plan.items()})
    return [owner for owner, _, _ in planned]


def tensor_parallel_plans(model: torch.nn.Module, degree: int) -> List[Tuple[str, torch.nn.Module, Dict[str, Any]]]:
    """``(name, submodule, plan)`` of each submodule with a plan, checked against ``degree``; refuses a model
    without one. No process group needed: `RayTrainer` calls it on the driver, on the meta device."""
    planned: List[Tuple[str, torch.nn.Module, Dict[str, Any]]] = []
    for owner, module in model.named_modules():
        method = getattr(module, PLAN_METHOD, None)
        if not callable(method):
            continue
        plan = method(degree)
        if not isinstance(plan, dict) or not plan:
            raise ValueError(
                f"{type(module).__name__}.{PLAN_METHOD}({degree}) returned {plan!r}; it must return a non-empty "
                "dict {submodule name: 'colwise' | 'rowwise' | ParallelStyle}."
            )
        label = owner or type(model).__name__
        for name, value in plan.items():
            _check_entry(label, module, name, value, degree)
        planned.append((owner, module, plan))
    if not planned:
        raise ValueError(
            f"tensor_parallel={degree}, but no submodule of {type(model).__name__} has a {PLAN_METHOD}(degree) "
            "method saying which Linear layers to split. Fix: add one to the model's blocks (see "
            "raytrain_events/parallel/tensor_parallel.py and examples/transformer_lm.py), or use tensor_parallel=1."
        )
    return planned


def _checksum(inputs: Any) -> torch.Tensor:
    """Three float64 numbers that differ (in practice) when the tensors in ``inputs`` differ:
    their element count, their sum, and a position-weighted sum."""

    tensors = [t.detach() for t in tree_flatten(inputs)[0] if torch.is_tensor(t)]
    device = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(3, dtype=torch.float64, device=device)
    for tensor in tensors:
        flat = tensor.reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), device=device, dtype=torch.float64).remainder_(1021).add_(1)
        out += torch.stack([torch.tensor(float(flat.numel()), device=device), flat.sum(), (flat * weights).sum()])
    return out


def check_first_batch_agrees(model: torch.nn.Module, degree: int) -> None:
    """On ``model``'s first forward, all-gather a checksum of every rank's inputs and raise ValueError
    on every rank if the ``degree`` consecutive ranks of any tensor group got different inputs (one
    all-gather of 3 numbers per rank, once, over all ranks so that no group goes on alone into FSDP's
    collectives; the hook then removes itself)."""
    import torch.distributed as dist

    def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        mine = _checksum((args, kwargs))
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        bad = [
            list(range(start, start + degree))
            for start in range(0, len(gathered), degree)
            if any(not torch.equal(gathered[start], other) for other in gathered[start : start + degree])
        ]
        if bad:
            raise ValueError(
                f"tensor_parallel={degree}: the ranks of tensor groups {bad} got different batches; they must load "
                "the same ones, since together they compute one replica. Fix: shard the data by the data-parallel "
                "rank, trainer.parallel.data_parallel(rank, world_size) = (rank // tensor_parallel, world_size // "
                "tensor_parallel), e.g. DistributedSampler(num_replicas=world_size // tensor_parallel, rank=rank // "
                "tensor_parallel). (RayTrainer's train set does this itself; a dataset read per worker, e.g. "
                "ray.train.get_dataset_shard in your own loop, does not.)"
            )

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
