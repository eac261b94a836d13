"""Wrap the model for data parallelism: DDP (a replica per rank) or FSDP2 (sharded), and say
which algorithms cannot run sharded.

`Parallel` is what the `Trainer` holds: ``wrap`` returns the module the loop calls (the DDP
wrapper, or the model itself, sharded in place by ``fully_shard``), and ``no_sync`` is the
grad-accumulation context of either (``DDP.no_sync`` / ``set_requires_gradient_sync(False)``).
``state.model`` stays the user's module in both cases; under FSDP its parameters are DTensors
holding this rank's shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from raytrain_events._torch_compat import activation_checkpoint as checkpoint
from raytrain_events._torch_compat import flatten_mesh
from raytrain_events.parallel.config import FSDPConfig, ParallelismSpec, parse_parallelism
from raytrain_events.parallel.context_parallel import ContextParallel
from raytrain_events.parallel.context_parallel import check_model as check_context_model
from raytrain_events.parallel.deferred_init import DeferredInit, has_meta_tensors
from raytrain_events.parallel.pipeline import Pipeline, check_algorithms_for_pipeline
from raytrain_events.parallel.tensor_parallel import apply_tensor_parallel, check_first_batch_agrees

__all__ = ["Parallel", "apply_fsdp", "check_algorithms_for_sharding", "is_sharded_module"]

# Algorithms that cannot run on sharded parameters, and why (checked when the Trainer is built).
_UNSHARDABLE = {
    "SWA": (
        "SWA keeps torch.optim.swa_utils.AveragedModel, a deep copy of the model; a copy of an FSDP-sharded "
        "module is not a sharded module of its own (its forward would all-gather into the original's buffers). "
        "Fix: use EMA (which averages the sharded parameters in place), or parallelism='ddp'."
    ),
}


def is_sharded_module(module: torch.nn.Module) -> bool:
    """True if ``fully_shard`` was applied to ``module`` (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def check_algorithms_for_sharding(algorithms: Sequence[Any]) -> None:
    """Raise ValueError naming each algorithm that cannot run with FSDP, with the reason."""
    problems = [
        f"{type(a).__name__}: {_UNSHARDABLE[type(a).__name__]}" for a in algorithms if type(a).__name__ in _UNSHARDABLE
    ]
    problems += [
        f"{type(a).__name__}: it needs backward(create_graph=True), which FSDP's gradient reduce-scatter "
        "does not support. Fix: use parallelism='ddp'."
        for a in algorithms
        if getattr(a, "backwards_create_graph", False)
    ]
    if problems:
        raise ValueError("These algorithms cannot run with parallelism='fsdp':\n  " + "\n  ".join(problems))


def _selector(policy: Any) -> Optional[Callable[[torch.nn.Module], bool]]:
    if policy is None or policy is False:
        return None
    if callable(policy):
        return policy
    names = set(policy)
    return lambda module: type(module).__name__ in names


def build_mesh(config: FSDPConfig, world_size: int, device: torch.device) -> Any:
    """The DeviceMesh of ``config`` over ``world_size`` ranks (`FSDPConfig.mesh_dim_names`)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, config.mesh_shape(world_size), mesh_dim_names=config.mesh_dim_names())


def fsdp_mesh(mesh: Any, config: FSDPConfig) -> Any:
    """The part of ``mesh`` FSDP works over: ``shard`` (``replicate, shard`` for HSDP); under context
    parallelism ``shard x context`` flattened into one dimension (as torchtitan's ``dp_shard_cp``)."""
    shard = "shard"
    if config.context_parallel > 1:
        shard = "shard_context"
        flat = flatten_mesh(mesh["shard", "context"], shard)
        if config.replicate == 1:
            return flat
    return mesh["replicate", shard] if config.replicate > 1 else mesh[shard]


def apply_fsdp(
    model: torch.nn.Module, config: FSDPConfig, world_size: int, device: torch.device, mesh: Any = None
) -> torch.nn.Module:
    """Shard ``model`` in place over ``world_size`` ranks (needs a process group): a 1-D mesh, or for
    HSDP (``config.replicate > 1``) a 2-D ``(replicate, shard)`` mesh, which ``fully_shard`` replicates
    over its first dimension and shards over its second. With ``config.tensor_parallel > 1`` the mesh
    is ``(shard, tensor)``: the model's plan splits its layers over ``tensor`` first, then FSDP shards
    over ``shard`` (parameters become 2-D DTensors); with both, ``(replicate, shard, tensor)``: TP over
    ``tensor``, then HSDP over ``(replicate, shard)`` (split layers become 3-D DTensors). ``mesh``:
    one `build_mesh` made (the `Parallel` keeps it for context parallelism's groups)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = build_mesh(config, world_size, device)
    if config.tensor_parallel > 1:
        apply_tensor_parallel(model, mesh["tensor"], config.tensor_parallel)
        check_first_batch_agrees(model, config.tensor_parallel)
    mesh = fsdp_mesh(mesh, config)
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
    if config.param_dtype is not None or config.reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=config.dtype("param_dtype"), reduce_dtype=config.dtype("reduce_dtype")
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    select = _selector(config.shard_modules)
    units = [m for m in model.modules() if m is not model and select is not None and select(m)]
    if config.shard_modules is not None and not units:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"FSDPConfig.shard_modules={config.shard_modules!r} matched no submodule of {type(model).__name__}; "
            f"its module classes are {present}. Fix: name one of those, or pass a function module -> bool."
        )
    ac = config.activation_checkpointing
    if ac:
        ac_select = select if ac is True else _selector(ac)
        targets = [m for m in model.modules() if m is not model and ac_select(m)]
        if not targets:
            raise ValueError(
                f"FSDPConfig.activation_checkpointing={ac!r} matched no submodule of {type(model).__name__}."
            )
        for module in targets:
            checkpoint(module)
    for module in reversed(units):  # innermost first: a unit's parameters exclude its sharded children
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_stages(pipeline: Pipeline, model: torch.nn.Module, world_size: int, device: torch.device, mesh: Any) -> None:
    """Pipeline parallelism: tensor parallelism over the layers ``model`` kept (once), then FSDP over
    each of this rank's stages, each its own root unit (the stage module `PipelineStage` runs)."""
    config = pipeline.config
    if config.tensor_parallel > 1:
        apply_tensor_parallel(model, mesh["tensor"], config.tensor_parallel)
    per_stage = dataclasses.replace(config, tensor_parallel=1)  # applied above, to the kept layers
    for module in pipeline.modules:
        apply_fsdp(module, per_stage, world_size, device, mesh)


class Parallel:
    """The data-parallel strategy of one `Trainer` (built from its ``parallelism`` option)."""

    def __init__(self, parallelism: Any = None, model: Optional[torch.nn.Module] = None) -> None:
        self.spec: ParallelismSpec = parse_parallelism(parallelism)
        # A model built on the meta device: materialised after sharding (deferred_init.py); the RNG
        # state is taken now, before the Trainer seeds anything, so init draws what eager init drew.
        self.deferred: Optional[DeferredInit] = (
            DeferredInit(model) if model is not None and has_meta_tensors(model) else None
        )
        self.context: Optional[ContextParallel] = None  # set by `wrap` under context parallelism
        self.pipeline: Optional[Pipeline] = None  # set by `wrap` under pipeline parallelism

    def place(self, model: torch.nn.Module, device: torch.device) -> None:
        """Move ``model`` to ``device``, unless it is built on meta (materialised by `wrap`, after sharding)."""
        if self.deferred is None:
            model.to(device)

    @property
    def kind(self) -> str:
        """``"ddp"`` or ``"fsdp"``."""
        return self.spec.kind

    @property
    def sharded(self) -> bool:
        """True for FSDP: parameters, gradients and optimizer state are sharded across ranks."""
        return self.spec.sharded

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree (1: none)."""
        return self.spec.tensor_parallel

    def data_parallel(self, rank: int, world_size: int) -> tuple:
        """``(data-parallel rank, data-parallel size)``: what to shard the data by. Under tensor, context
        and pipeline parallelism the ``pipeline_parallel * context_parallel * tensor_parallel`` ranks
        of one group share a data-parallel rank (they must load the same batches): consecutive ranks,
        or with ``pipeline_outermost`` a pipeline's stages ``world_size / p`` apart; otherwise
        ``(rank, world_size)`` (`ParallelismSpec.data_coordinates`)."""
        return self.spec.data_coordinates(rank, world_size)

    def counts_data(self, rank: int, world_size: int) -> bool:
        """Whether this rank's samples and tokens count in the global sums: every rank's, except
        under tensor, context or pipeline parallelism, where one rank per group (the first stage's
        first) counts the group's shared batch."""
        return self.spec.counts_data(rank, world_size)

    def split(self, batch: Any) -> Any:
        """This rank's part of a training microbatch: under context parallelism the model's cut
        along the sequence (`ContextParallel.split`), else ``batch`` itself."""
        return batch if self.context is None else self.context.split(batch)

    def check(self, algorithms: Sequence[Any]) -> None:
        """Refuse (ValueError with the reason) algorithms that cannot run with this strategy."""
        if self.sharded:
            check_algorithms_for_sharding(algorithms)
        if self.spec.pipeline_parallel > 1:
            check_algorithms_for_pipeline(algorithms, self.spec.pipeline_parallel)

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The microbatch's loss as the model's (context parallelism: the group's mean of its parts), else ``loss``."""
        return loss if self.context is None else self.context.whole_loss(loss)

    def wrap(
        self, model: torch.nn.Module, dist: Any, device: torch.device, find_unused: bool, optimizers: Sequence[Any] = ()
    ) -> torch.nn.Module:
        """The module the loop calls: ``model`` alone on one rank, DDP, or ``model`` sharded in place.

        Sharding replaces the parameters by DTensor shards, and a model built on the meta device is
        materialised (after sharding: only this rank's shards); the ``optimizers`` (built on the
        original parameters, with no state yet) are pointed at the new ones.
        """
        for name in ("tensor_parallel", "context_parallel", "pipeline_parallel"):
            degree = getattr(self.spec, name)
            if degree > 1 and not dist.is_distributed:
                raise ValueError(
                    f"FSDPConfig({name}={degree}) needs {degree} or more ranks, but this run has one process. Fix: "
                    f"run on a multiple of {name} workers, or {name}=1."
                )
        sharded = self.sharded and dist.is_distributed
        if sharded or self.deferred is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            _check_optimizers_fresh(optimizers)
            if sharded:
                config = self.spec.fsdp
                assert config is not None
                if config.context_parallel > 1:
                    check_context_model(model, config.context_parallel)
                mesh = build_mesh(config, dist.world_size, device)
                if config.context_parallel > 1:
                    self.context = ContextParallel(model, mesh, config.context_parallel)
                if config.pipeline_parallel > 1:  # this rank's stages only, each sharded (pipeline.py)
                    self.pipeline = Pipeline(model, config, mesh, self.context)
                    shard_stages(self.pipeline, model, dist.world_size, device, mesh)
                else:
                    apply_fsdp(model, config, dist.world_size, device, mesh)
            if self.deferred is not None:
                self.deferred.materialize(model, device, sharded)
                self.deferred = None
            _retarget_optimizers(optimizers, names, dict(model.named_parameters()), self.pipeline is not None)
            if self.pipeline is not None:
                self.pipeline.build_schedule(device)
        if not dist.is_distributed or sharded:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=find_unused)

    @staticmethod
    @contextlib.contextmanager
    def no_sync(train_model: torch.nn.Module) -> Iterator[None]:
        """Accumulate gradients locally (no all-reduce / reduce-scatter) inside this context."""
        if hasattr(train_model, "no_sync"):  # DDP
            with train_model.no_sync():
                yield
        elif hasattr(train_model, "set_requires_gradient_sync"):  # FSDP2
            train_model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                train_model.set_requires_gradient_sync(True)
        else:  # one rank: nothing to synchronize
            yield


def _check_optimizers_fresh(optimizers: Sequence[Any]) -> None:
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                f"{type(optimizer).__name__} already has state (it stepped before the model was sharded); FSDP "
                "replaces the parameters, so the optimizer must be fresh. Fix: pass a newly built optimizer."
            )


def _retarget_optimizers(optimizers: Sequence[Any], old_names: dict, new_params: dict, pruned: bool = False) -> None:
    """Point each optimizer's param groups at the sharded parameters (same names, new objects);
    ``pruned`` (pipeline parallelism): drop the parameters of the other stages' layers."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            retargeted = []
            for param in group["params"]:
                name = old_names.get(id(param))
                if pruned and name is not None and name not in new_params:
                    continue  # another stage's layer
                if name is None or name not in new_params:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a parameter that is not one of the model's "
                        f"(shape {tuple(param.shape)}); with FSDP the optimizer may only hold model parameters."
                    )
                retargeted.append(new_params[name])
            group["params"] = retargeted
