"""How the model is spread over the ranks: `FSDPConfig`, and parsing of the ``parallelism`` option.

``parallelism="ddp"`` (the default) keeps a full replica per rank (DistributedDataParallel).
``parallelism="fsdp"`` or an `FSDPConfig` shards parameters, gradients and optimizer state over
the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), so a model that does not fit one
device can be trained. Plain data only here; the wrapping itself is in ``wrap.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from raytrain_events.parallel.world import check_tensor_parallel_world

__all__ = ["FSDPConfig", "PIPELINE_SCHEDULES", "ParallelismSpec", "check_pipeline_options", "parse_parallelism"]

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
        pipeline_parallel: pipeline parallelism of degree ``p``: the model's blocks are cut into stages,
            each group of ``p`` consecutive ranks (outside the context and tensor groups: the mesh is
            ``(replicate, shard, pipeline, context, tensor)``, see `mesh_dim_names`) runs one pipeline,
            one stage per rank (``pipeline_stages_per_rank`` with an interleaved schedule), and FSDP
            shards each stage over ``shard`` (``shard x context`` under CP, whose ranks split each
            stage's attention); see ``pipeline.py``. The ``p * context_parallel * tensor_parallel``
            ranks of a pipeline load the same batches. 1: none.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved1f1b"`` or ``"loopedbfs"``
            (``torch.distributed.pipelining``'s schedules; the last two hold several stages per rank).
        pipeline_microbatches: microbatches per batch the schedule runs (None: ``p``, the fewest
            1F1B and the interleaved schedules accept; more shrink the bubble, see docs/big-models.md).
        pipeline_stages_per_rank: stages each rank holds (None: 1, or 2 for an interleaved schedule).
        pipeline_split: blocks per stage, e.g. ``[3, 5]`` (``p * pipeline_stages_per_rank`` entries
            summing to the block count); None: an even split of the model's block list.
        pipeline_outermost: put the pipeline dimension outermost, torchtitan's order ``(pipeline,
            replicate, shard, context, tensor)``: a stage's FSDP (and TP) groups are then consecutive ranks, within
            a node, and only the pipeline's small point-to-point sends cross nodes (the layout for slow
            inter-node links); a pipeline's stages are ranks ``r, r + W/p, ...``, which load the same
            batches (`ParallelismSpec.data_coordinates`; `RayTrainer` serves them so,
            `ParallelismSpec.serving_rank`). False (default): ``(replicate, shard, pipeline, context,
            tensor)``, a pipeline on consecutive ranks.
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
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: Optional[int] = None
    pipeline_stages_per_rank: Optional[int] = None
    pipeline_split: Optional[Sequence[int]] = None
    pipeline_outermost: bool = False

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
        check_pipeline_options(self)
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
        tp, cp, pp = self.tensor_parallel, self.context_parallel, self.pipeline_parallel
        check_tensor_parallel_world(world_size, tp, cp)
        group = self.replicate * pp * cp * tp
        if world_size % group:
            degrees = (("replicate", self.replicate), ("pipeline_parallel", pp), ("context_parallel", cp))
            given = [f"{n}={v}" for n, v in degrees if v > 1]
            given += [f"tensor_parallel={tp}"] if tp > 1 else []
            raise ValueError(
                f"FSDPConfig({', '.join(given)}) needs a world size divisible by {group}, got {world_size} ranks (the "
                f"mesh's degrees multiply to {group}). Fix: use a multiple of {group} workers, or another replicate."
            )
        shard = world_size // group
        sizes = {"replicate": self.replicate, "shard": shard, "pipeline": pp, "context": cp, "tensor": tp}
        return tuple(sizes[name] for name in self.mesh_dim_names())

    def mesh_dim_names(self) -> tuple:
        """The names of `mesh_shape`'s dimensions, outermost first, in the one order
        ``(replicate, shard, pipeline, context, tensor)``, each present when its degree is above 1
        (``"shard"`` always): ``("shard",)``, ``("replicate", "shard")``, ``("shard", "tensor")``,
        ``("replicate", "shard", "tensor")``, ``("shard", "context")``, ``("shard", "pipeline",
        "tensor")``, ``("shard", "pipeline", "context")``... Consecutive ranks share the innermost
        dimensions, so a tensor group (then a context group, then a pipeline) sits within a node, and
        every rank that loads one batch (a pipeline's stages and their context and tensor ranks) is in
        one consecutive group. With ``pipeline_outermost`` the pipeline comes first, torchtitan's
        order ``(pipeline, replicate, shard, context, tensor)``: ``("pipeline", "shard", "tensor")``..."""
        outermost = self.pipeline_outermost and self.pipeline_parallel > 1
        names = ("pipeline",) if outermost else ()
        names += ("replicate",) if self.replicate > 1 else ()
        names += ("shard",) + (("pipeline",) if self.pipeline_parallel > 1 and not outermost else ())
        names += ("context",) if self.context_parallel > 1 else ()
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
    def pipeline_parallel(self) -> int:
        """The pipeline-parallel degree (1: none)."""
        return self.fsdp.pipeline_parallel if self.fsdp is not None else 1

    @property
    def batch_group(self) -> int:
        """The consecutive ranks that load the same rows: ``pipeline_parallel * context_parallel *
        tensor_parallel`` (every stage of a pipeline loads the batch: the first feeds it, the last
        computes the loss on it)."""
        return self.pipeline_parallel * self.context_parallel * self.tensor_parallel

    @property
    def pipeline_outermost(self) -> bool:
        """Whether the pipeline is the mesh's outermost dimension (`FSDPConfig.pipeline_outermost`)."""
        return self.fsdp is not None and self.fsdp.pipeline_outermost and self.pipeline_parallel > 1

    def data_coordinates(self, rank: int, world_size: int) -> Tuple[int, int]:
        """``(data-parallel rank, data-parallel size)`` of ``rank``: the ranks that load the same rows
        (a `batch_group`) share the rank. Consecutive ranks; with `pipeline_outermost` a pipeline's
        stages are ``world_size / p`` ranks apart, so the rank is ``rank``'s within its stage's ranks."""
        group = self.batch_group
        if self.pipeline_outermost:
            per_stage = world_size // self.pipeline_parallel
            return (rank % per_stage) // (group // self.pipeline_parallel), world_size // group
        return rank // group, world_size // group

    def serving_rank(self, rank: int, world_size: int) -> int:
        """The rank `RayTrainer`'s data path (its feeder and eval splits, which serve each `batch_group`
        of *consecutive* ranks the same rows) serves ``rank`` as: ``rank`` itself, or with
        `pipeline_outermost` (a pipeline's stages ``world_size / p`` ranks apart) the rank at this
        rank's stage in its data-parallel rank's consecutive group, so ``serving_rank // batch_group``
        is `data_coordinates`' rank. A permutation of ``0 .. world_size - 1``."""
        if not self.pipeline_outermost:
            return rank
        per_stage, inner = world_size // self.pipeline_parallel, self.batch_group // self.pipeline_parallel
        stage, within = divmod(rank, per_stage)
        return (within // inner) * self.batch_group + stage * inner + within % inner

    def counts_data(self, rank: int, world_size: int) -> bool:
        """Whether ``rank``'s samples and tokens count in the global sums: one rank per `batch_group`
        (the first stage's first rank of its tensor group)."""
        if self.pipeline_outermost:
            return (
                rank < world_size // self.pipeline_parallel and rank % (self.batch_group // self.pipeline_parallel) == 0
            )
        return rank % self.batch_group == 0


def check_pipeline_options(config: FSDPConfig) -> None:
    """Refuse pipeline options that cannot run, naming the fix (those needing the model are in
    ``pipeline_split.py``, those needing the world size in `FSDPConfig.mesh_shape`)."""
    pp, schedule = config.pipeline_parallel, config.pipeline_schedule
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"FSDPConfig.pipeline_parallel={pp!r} must be an integer >= 1 (pipeline stages; 1: none).")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"FSDPConfig.pipeline_schedule={schedule!r} is not one of {sorted(PIPELINE_SCHEDULES)}.")
    if not isinstance(config.pipeline_outermost, bool):
        raise ValueError(f"FSDPConfig.pipeline_outermost={config.pipeline_outermost!r} must be True or False.")
    if pp == 1:
        return
    interleaved = PIPELINE_SCHEDULES[schedule][1]
    _check_stages_per_rank(config, interleaved)
    _check_microbatches(config, interleaved)
    per_rank = config.pipeline_stages_per_rank
    split = config.pipeline_split
    if split is not None:
        stages = pp * per_rank
        if len(split) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
            raise ValueError(
                f"FSDPConfig.pipeline_split={list(split)!r} must give {stages} block counts >= 1 (pipeline_parallel "
                f"{pp} x pipeline_stages_per_rank {per_rank} stages), first stage first."
            )
        config.pipeline_split = list(split)


def _check_stages_per_rank(config: FSDPConfig, interleaved: bool) -> None:
    schedule, per_rank = config.pipeline_schedule, config.pipeline_stages_per_rank
    if per_rank is None:
        per_rank = config.pipeline_stages_per_rank = 2 if interleaved else 1
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1 or (per_rank > 1) != interleaved:
        need = "an integer >= 2 (it holds several stages per rank)" if interleaved else "1 (one stage per rank)"
        raise ValueError(
            f"FSDPConfig(pipeline_schedule={schedule!r}, pipeline_stages_per_rank={per_rank!r}): the schedule needs "
            f"{need}. Fix: pipeline_stages_per_rank=None (its default), or another schedule."
        )


def _check_microbatches(config: FSDPConfig, interleaved: bool) -> None:
    pp, schedule, micro = config.pipeline_parallel, config.pipeline_schedule, config.pipeline_microbatches
    if micro is None:
        micro = config.pipeline_microbatches = pp
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"FSDPConfig.pipeline_microbatches={micro!r} must be an integer >= 1.")
    if schedule != "gpipe" and micro < pp:
        raise ValueError(
            f"FSDPConfig(pipeline_schedule={schedule!r}, pipeline_microbatches={micro}) runs fewer microbatches than "
            f"its {pp} pipeline stages, which this schedule cannot fill. Fix: pipeline_microbatches >= {pp} (a "
            "multiple of it for an interleaved schedule), or pipeline_schedule='gpipe'."
        )
    if interleaved and micro % pp:
        raise ValueError(
            f"FSDPConfig(pipeline_schedule={schedule!r}, pipeline_microbatches={micro}): an interleaved schedule runs "
            f"the microbatches in rounds of {pp} (the stages). Fix: a multiple of {pp}, e.g. {micro + pp - micro % pp}."
        )


#: The pipeline schedules by name: ``torch.distributed.pipelining``'s class, and whether it holds
#: several stages per rank (interleaved).
PIPELINE_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", True),
    "loopedbfs": ("ScheduleLoopedBFS", True),
}


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
