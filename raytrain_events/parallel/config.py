"""How the model is spread over the ranks: `FSDPConfig`, and parsing of the ``parallelism`` option.

``parallelism="ddp"`` (the default) keeps a full replica per rank (DistributedDataParallel).
``parallelism="fsdp"`` or an `FSDPConfig` shards parameters, gradients and optimizer state over
the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), so a model that does not fit one
device can be trained. Plain data only here; the wrapping itself is in ``wrap.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch

from raytrain_events.parallel.world import check_tensor_parallel_world

__all__ = ["FSDPConfig", "ParallelismSpec", "parse_parallelism"]

ModulePolicy = Union[Sequence[str], Callable[[torch.nn.Module], bool], None]
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass
class FSDPConfig:
    """FSDP2 options (Composer's ``parallelism_config.fsdp``, Ray Train's FSDP2 template).

    Example::

        Trainer(..., parallelism=FSDPConfig(shard_modules=["TransformerBlock"], param_dtype="bf16"))

    Fields:
        shard_modules: which submodules get their own ``fully_shard`` unit (one all-gather each,
            freed after use): class names (``["TransformerBlock"]``) or a function
            ``module -> bool``. The root module is always sharded last (it takes what is left).
            None: only the root, i.e. one unit (the least overlap; fine for small models).
        reshard_after_forward: free the gathered parameters after forward (less memory, one more
            all-gather in backward), as ZeRO-3; False keeps them until backward (ZeRO-2-like).
        param_dtype / reduce_dtype: mixed precision of FSDP itself (``MixedPrecisionPolicy``):
            the dtype of the gathered parameters for compute and of the gradient reduce-scatter,
            ``"bf16"``, ``"fp16"``, ``"fp32"`` or None (the parameter's own dtype).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``), moved to the device for compute only.
        activation_checkpointing: recompute activations in backward for these submodules
            (class names, a function ``module -> bool``, or True for the ``shard_modules``).
        replicate: HSDP: ``k`` replica groups, each sharding the model over ``world_size / k``
            consecutive ranks (a 2-D DeviceMesh ``(k, world_size / k)``); gathers stay within a
            group (a node), only gradient shards are all-reduced across groups. 1: plain FSDP. With
            ``tensor_parallel=t`` too, the mesh is 3-D ``(replicate, shard, tensor)``: TP inside each
            group of ``t`` consecutive ranks, FSDP gathers within ``shard``, replicas across ``replicate``.
        tensor_parallel: tensor parallelism of degree ``t``: a 2-D DeviceMesh ``(world_size / t, t)``
            named ``("shard", "tensor")``; each group of ``t`` consecutive ranks splits every layer the
            model's ``tensor_parallel_plan(t)`` names (``parallelize_module``), and FSDP shards over the
            ``world_size / t`` groups. The ``t`` ranks of a group must load the same batches
            (`Parallel.data_parallel_rank`); see ``tensor_parallel.py``. 1: no tensor parallelism.
        context_parallel: context parallelism of degree ``c``: each group of ``c`` ranks (outside the
            tensor groups: ``(replicate, shard, context, tensor)``) splits every row's sequence and
            attention (SDPA), for sequences too long for one device; FSDP shards over ``shard x context``.
            The model cuts its batches (``context_parallel_split``); see ``context_parallel.py``.
            1: none. Not with ``activation_checkpointing`` (its recompute would attend unsplit).
    """

    shard_modules: ModulePolicy = None
    reshard_after_forward: bool = True
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    cpu_offload: bool = False
    activation_checkpointing: Union[bool, Sequence[str], Callable[[torch.nn.Module], bool]] = False
    replicate: int = 1
    tensor_parallel: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.replicate, bool) or not isinstance(self.replicate, int) or self.replicate < 1:
            raise ValueError(f"FSDPConfig.replicate={self.replicate!r} must be an integer >= 1 (HSDP replica groups).")
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(
                f"FSDPConfig.tensor_parallel={tp!r} must be an integer >= 1 (ranks that split each layer; 1: none)."
            )
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(
                f"FSDPConfig.context_parallel={cp!r} must be an integer >= 1 (ranks that split each sequence; 1: none)."
            )
        if cp > 1 and self.activation_checkpointing:
            raise ValueError(
                f"FSDPConfig(context_parallel={cp}, activation_checkpointing={self.activation_checkpointing!r}) is not "
                "supported: the recompute in backward would run attention on this rank's part of the sequence alone. "
                "Fix: activation_checkpointing=False (context parallelism already divides activations by "
                f"{cp}), or context_parallel=1."
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ValueError(f"FSDPConfig.{name}={value!r} is not a dtype name: use one of {sorted(_DTYPES)}.")
        if isinstance(self.shard_modules, str):
            self.shard_modules = [self.shard_modules]
        if isinstance(self.activation_checkpointing, str):
            self.activation_checkpointing = [self.activation_checkpointing]
        if self.activation_checkpointing is True and self.shard_modules is None:
            raise ValueError(
                "FSDPConfig(activation_checkpointing=True) checkpoints the shard_modules, but none are given: "
                "name them (shard_modules=['Block']) or pass activation_checkpointing=['Block']."
            )

    def dtype(self, name: str) -> Optional[torch.dtype]:
        """``param_dtype`` or ``reduce_dtype`` as a torch dtype (None: unchanged)."""
        value = getattr(self, name)
        return None if value is None else _DTYPES[value]

    def mesh_shape(self, world_size: int) -> tuple:
        """The DeviceMesh's shape, one entry per `mesh_dim_names`: ``(world_size,)`` for FSDP,
        ``(replicate, world_size // replicate)`` for HSDP, ``(world_size // t, t)`` for FSDP x TP and
        ``(replicate, world_size // (replicate * t), t)`` for HSDP x TP; a split that leaves part of a
        group raises naming the fix."""
        tp, cp = self.tensor_parallel, self.context_parallel
        check_tensor_parallel_world(world_size, tp, cp)
        if world_size % (self.replicate * cp * tp):
            given = [f"{n}={v}" for n, v in (("replicate", self.replicate), ("context_parallel", cp)) if v > 1]
            given += [f"tensor_parallel={tp}"] if tp > 1 else []
            raise ValueError(
                f"FSDPConfig({', '.join(given)}) needs a world size divisible by {self.replicate * cp * tp}, got "
                f"{world_size} ranks. Fix: use a multiple of {self.replicate * cp * tp} workers, or another replicate."
            )
        shard = world_size // (self.replicate * cp * tp)
        sizes = {"replicate": self.replicate, "shard": shard, "context": cp, "tensor": tp}
        return tuple(sizes[name] for name in self.mesh_dim_names())

    def mesh_dim_names(self) -> tuple:
        """The names of `mesh_shape`'s dimensions, outermost first: ``"replicate"`` (HSDP only),
        ``"shard"``, ``"context"`` (CP only), then ``"tensor"`` (TP only): ``("shard",)``,
        ``("replicate", "shard")``, ``("shard", "tensor")``, ``("replicate", "shard", "tensor")``,
        ``("shard", "context")``... Consecutive ranks share the innermost dimensions, so a tensor
        group (and then a context group) sits within a node."""
        names = ("replicate",) if self.replicate > 1 else ()
        names += ("shard",) + (("context",) if self.context_parallel > 1 else ())
        return names + (("tensor",) if self.tensor_parallel > 1 else ())


@dataclass(frozen=True)
class ParallelismSpec:
    """The parsed ``parallelism`` option: ``kind`` is "ddp" or "fsdp"; ``fsdp`` its options."""

    kind: str
    fsdp: Optional[FSDPConfig] = None

    @property
    def sharded(self) -> bool:
        """True when parameters are sharded across ranks (FSDP)."""
        return self.kind == "fsdp"

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree (1: none)."""
        return self.fsdp.tensor_parallel if self.fsdp is not None else 1

    @property
    def context_parallel(self) -> int:
        """The context-parallel degree (1: none)."""
        return self.fsdp.context_parallel if self.fsdp is not None else 1

    @property
    def batch_group(self) -> int:
        """The consecutive ranks that load the same rows: ``context_parallel * tensor_parallel``."""
        return self.context_parallel * self.tensor_parallel


def parse_parallelism(value: Union[str, FSDPConfig, ParallelismSpec, Dict[str, Any], None]) -> ParallelismSpec:
    """Accept ``"ddp"``, ``"fsdp"``, an `FSDPConfig`, a dict of `FSDPConfig` fields, or None (ddp)."""
    if value is None or value == "ddp":
        return ParallelismSpec("ddp")
    if isinstance(value, ParallelismSpec):
        return value
    if value == "fsdp":
        return ParallelismSpec("fsdp", FSDPConfig())
    if isinstance(value, FSDPConfig):
        return ParallelismSpec("fsdp", value)
    if isinstance(value, dict):
        try:
            return ParallelismSpec("fsdp", FSDPConfig(**value))
        except TypeError as e:
            raise ValueError(f"parallelism={value!r}: {e}. The keys are FSDPConfig's fields.") from None
    raise ValueError(
        f"parallelism={value!r} is not supported: pass 'ddp' (the default), 'fsdp', or an FSDPConfig(...)."
    )
