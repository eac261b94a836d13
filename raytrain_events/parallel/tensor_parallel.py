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
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

__all__ = ["PLAN_METHOD", "apply_tensor_parallel", "data_parallel_coordinates"]

PLAN_METHOD = "tensor_parallel_plan"
_SPLIT_DIM = {"colwise": ("out_features", "output features"), "rowwise": ("in_features", "input features")}


def data_parallel_coordinates(rank: int, world_size: int, degree: int) -> Tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of ``rank`` on a ``(world_size / degree, degree)``
    mesh: the ``degree`` consecutive ranks of a tensor group share one data-parallel rank (one batch)."""
    return rank // degree, world_size // degree


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
    for _, module, plan in planned:
        parallelize_module(module, tp_mesh, {name: _style(name, value) for name, value in plan.items()})
    return [owner for owner, _, _ in planned]
