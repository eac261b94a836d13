"""Context parallelism (CP): split each row's sequence over a group of ``c`` ranks, so that
sequences too long for one device's activations can train (``FSDPConfig(context_parallel=c)``).

The ``c`` ranks of a CP group load the same rows (as a tensor group does, `Parallel.data_parallel`);
before each microbatch's forward every rank keeps its part of the sequence, cut by the model's
``context_parallel_split(batch, index, degree)`` (`split_token_batch` for ``{"input_ids"}``
language-model batches). The cut is load-balanced for causal attention as torchtitan's: the
sequence is cut into ``2c`` chunks and rank ``i`` takes chunks ``i`` and ``2c - 1 - i``, so every rank
attends over the same number of (query, key) pairs. Labels are shifted *before* the cut, so the
next token of a chunk's last position is the first of the next chunk, wherever that lives.

Attention: while the model runs forward in training, every
``torch.nn.functional.scaled_dot_product_attention`` call is routed (a ``TorchFunctionMode``)
to `context_parallel_attention`: the keys and values of the group are all-gathered (one
collective of ``2 * S/c * d`` per rank per attention layer, differentiable: backward sums each
rank's keys' and values' gradients over the group, a reduce-scatter (an all-reduce on gloo)) and this rank's queries attend over
the whole sequence under the causal mask of their global positions. That is the all-gather
variant of ring attention (torchtitan's ``rotate_method="allgather"``), chosen because torch's
own ``context_parallel`` has no CPU kernel (its ring is registered for the GPU SDPA ops only) and
because it is exact and needs only public collectives; its cost: each rank holds the whole
sequence's keys and values of one layer during its attention (``O(S)``), while the score matrix
and every other activation are ``O(S/c)``. A lent GPU could route to torch's ring instead.

Under pipeline parallelism (``pipeline_parallel=p``; mesh ``(replicate, shard, pipeline, context,
tensor)``) every stage's attention runs split the same way: the ``c`` ranks of a stage (one pipeline
each, exchanging activations with the same context rank of the next stage) cut every microbatch
(`ContextParallel.split`, on every stage: the ranks of a pipeline hold the batch), and each stage's
forward runs under `ContextParallel.routing` (``pipeline_split.StageModule``); the last stage's loss
parts reach every rank through the pipeline's per-batch sum (``pipeline_step.PipelineCounters``).

Tokens are counted once per CP group (one rank counts the group's shared rows, as under TP: no
extra collective). Each rank's loss is its part's sum over ``label_count`` (the microbatch's labels
divided by ``c``), so the gradients averaged over the group's ranks are the unsplit model's; the
``state.loss`` every rank then sees is the model's loss (`ContextParallel.whole_loss`: the group's
mean, one scalar all-reduce per microbatch), so a callback logging it from rank 0 logs the right one.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

from raytrain_events._torch_compat import flatten_mesh

__all__ = [
    "IGNORE_INDEX",
    "SPLIT_METHOD",
    "METRIC_GROUPS",
    "ContextParallel",
    "check_model",
    "context_parallel_attention",
    "load_balanced_positions",
    "split_token_batch",
]

SPLIT_METHOD = "context_parallel_split"
IGNORE_INDEX = -100


def load_balanced_positions(length: int, degree: int, index: int, device: Any = None) -> torch.Tensor:
    """The sequence positions rank ``index`` of a CP group of ``degree`` keeps: chunks ``index`` and
    ``2 * degree - 1 - index`` of ``2 * degree`` equal chunks (so causal attention costs each rank the same)."""
    if length % (2 * degree):
        raise ValueError(
            f"context_parallel={degree} cuts each sequence into {2 * degree} equal chunks (two per rank, for "
            f"causal load balance), but the sequence has {length} positions. Fix: a sequence length divisible by "
            f"{2 * degree}, or another context_parallel."
        )
    size = length // (2 * degree)
    first = torch.arange(index * size, (index + 1) * size, device=device)
    return torch.cat([first, first.new_tensor(range((2 * degree - 1 - index) * size, (2 * degree - index) * size))])


def split_token_batch(batch: Dict[str, Any], index: int, degree: int) -> Dict[str, Any]:
    """Rank ``index``'s part of a ``{"input_ids": (rows, length), ...}`` batch: ``input_ids`` at its
    `load_balanced_positions`, the next-token ``labels`` there (shifted before the cut;
    `IGNORE_INDEX` after the last token), the global ``positions`` and ``label_count``, this rank's
    share of the microbatch's labels (the divisor of its loss). Other entries are kept as they are."""
    ids = batch["input_ids"]
    positions = load_balanced_positions(ids.shape[1], degree, index, ids.device)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    out = dict(batch)
    out.update(
        input_ids=ids[:, positions],
        labels=labels[:, positions],
        positions=positions,
        label_count=torch.tensor(ids.shape[0] * (ids.shape[1] - 1) / degree, device=ids.device),
    )
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 over a CP group; backward sums each rank's slice of the gradient over
    the group (a reduce-scatter, or on gloo, which has none, an all-reduce and a slice).

    Not ``torch.distributed.nn.functional.all_gather``: deprecated in torch 2.13, and its gloo
    backward scatters from *global* rank ``i`` of the group's ``i``-th member, which fails on any
    group but the whole world (a CP group under TP is ranks {0, 2}, ...)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, degree: int, index: int) -> torch.Tensor:
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(degree)]
        dist.all_gather(parts, tensor, group=group)
        ctx.group, ctx.index, ctx.local = group, index, tensor.shape[-2]
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        import torch.distributed as dist

        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = torch.empty_like(grad.narrow(-2, 0, ctx.local))
            dist.reduce_scatter(mine, [g.contiguous() for g in grad.split(ctx.local, dim=-2)], group=ctx.group)
        else:
            dist.all_reduce(grad, group=ctx.group)
            mine = grad.narrow(-2, ctx.index * ctx.local, ctx.local)
        return mine, None, None, None


def context_parallel_attention(  # noqa: PLR0913 -- scaled_dot_product_attention's own arguments, then the group's
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    group: Any,
    degree: int,
    positions: torch.Tensor,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this rank's queries (at global ``positions``) over the keys
    and values of every rank of the CP ``group`` (sequence dim -2): all-gathered, then one SDPA call
    under the mask of the global positions (and a given boolean mask over the keys in sequence order).
    Refuses dropout and any other mask."""
    import torch.distributed as dist
    import torch.nn.functional as F

    local = query.shape[-2]
    if dropout_p or (
        attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.shape[-1] != local * degree)
    ):
        raise NotImplementedError(
            "context_parallel attention supports causal attention, full attention or a boolean mask over the whole "
            "sequence's keys in sequence order (document_attention.document_mask), without dropout; this call passed "
            f"{'dropout_p=' + str(dropout_p) if dropout_p else 'another attn_mask'}. Fix: is_causal=True, "
            "document_attention(...) or no mask, and dropout_p=0 in the model's attention, or context_parallel=1."
        )
    index = dist.get_group_rank(group, dist.get_rank())
    keys, values = _GatherSequence.apply(torch.stack([key, value]), group, degree, index).unbind(0)
    mask = None
    every = torch.cat([load_balanced_positions(local * degree, degree, i, query.device) for i in range(degree)])
    if is_causal:  # key j is visible to query i when its global position is not after i's
        mask = every[None, :] <= positions[:, None]
    if attn_mask is not None:  # given over keys in sequence order: reordered as the keys were gathered
        mask = attn_mask[..., every] if mask is None else attn_mask[..., every] & mask
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


class _RouteAttention(TorchFunctionMode):
    """Sends ``scaled_dot_product_attention`` to `context_parallel_attention`; everything else as is."""

    def __init__(self, group: Any, degree: int, positions: torch.Tensor) -> None:
        super().__init__()
        self.group, self.degree, self.positions = group, degree, positions

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch.nn.functional as F

        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return context_parallel_attention(
                *args, **kwargs, group=self.group, degree=self.degree, positions=self.positions
            )
        return func(*args, **kwargs)


def check_model(model: torch.nn.Module, degree: int) -> None:
    """Refuse a model that cannot cut its batches along the sequence (before any sharding)."""
    if not callable(getattr(model, SPLIT_METHOD, None)):
        raise ValueError(
            f"context_parallel={degree}, but {type(model).__name__} has no {SPLIT_METHOD}(batch, index, degree) "
            "method saying how to cut its batches along the sequence (and its forward and loss must take the cut "
            "batch: global positions, labels shifted before the cut). Fix: add one (see "
            "raytrain_events/parallel/context_parallel.py `split_token_batch` and examples/transformer_lm.py), "
            "or context_parallel=1."
        )


#: model -> the process group its evaluation metrics sync over under context parallelism (one rank
#: per context x tensor group: those ranks evaluate the same whole rows); read by `metric_group`.
METRIC_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


class ContextParallel:
    """The CP state of one rank: its group (``mesh["context"]``), its index in it, and the hooks that
    route attention during training forwards (evaluation and prediction run whole rows, unrouted)."""

    def __init__(self, model: torch.nn.Module, mesh: Any, degree: int) -> None:
        check_model(model, degree)
        context = mesh["context"]
        self.model, self.group, self.degree, self.index = model, context.get_group(), degree, context.get_local_rank()
        names = mesh.mesh_dim_names
        if "replicate" in names:
            METRIC_GROUPS[model] = flatten_mesh(mesh["replicate", "shard"], "replicate_shard").get_group()
        else:
            METRIC_GROUPS[model] = mesh["shard"].get_group()
        self._mode: Optional[_RouteAttention] = None
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)

    def split(self, batch: Any) -> Any:
        """This rank's part of a training microbatch (the model's `SPLIT_METHOD`)."""
        return getattr(self.model, SPLIT_METHOD)(batch, self.index, self.degree)

    def routing(self, batch: Any) -> contextlib.AbstractContextManager[Any]:
        """What a pipeline stage's forward of ``batch`` runs in (``pipeline_split.StageModule``, which
        the model's own hooks do not reach): attention routed over the group for a training part (it
        has ``positions``), nothing for whole rows (evaluation, predict)."""
        if isinstance(batch, dict) and "positions" in batch:
            return _RouteAttention(self.group, self.degree, batch["positions"])
        return contextlib.nullcontext()

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The model's loss of the microbatch (detached), from this rank's part: the mean of the group's parts
        (each is its part's sum over a ``c``-th of the labels). One scalar all-reduce over the group per
        microbatch; the backward used the part, as it must."""
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=self.group)
        return total / self.degree

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        batch = args[0] if args else None
        if module.training and isinstance(batch, dict) and "positions" in batch:
            self._mode = _RouteAttention(self.group, self.degree, batch["positions"])
            self._mode.__enter__()

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
