"""Pipeline parallelism (PP) on the mesh: ``FSDPConfig(pipeline_parallel=p, pipeline_schedule=...)``.

The model's blocks are cut into stages (``pipeline_split.py``); each rank keeps only its stages'
layers, which tensor parallelism splits and FSDP shards over the ``shard`` dimension like any model,
one FSDP root per stage; `torch.distributed.pipelining` runs them (``PipelineStage`` per stage, and
its ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` / ``ScheduleLoopedBFS``).
The mesh is ``(replicate, shard, pipeline, context, tensor)``: the ``p`` stages of one pipeline are
consecutive ranks (outside the context and tensor groups), so every rank that loads a batch is in one
consecutive group of ``p * context_parallel * tensor_parallel`` ranks, as the data path shards by
(`Parallel.data_parallel`). Under context parallelism each context rank of a stage runs its own
pipeline (with the same context rank of the other stages) on its part of every microbatch's
sequence, and the stage's attention is split over its context group (``context_parallel.py``).
Stages send activations forward and gradients back point to point, within the pipeline only;
FSDP's all-gathers and reduce-scatters stay within a stage's ``shard`` (``shard x context``) group.

Per step a pipeline sends, per microbatch and stage boundary, one activation forward and one
gradient back (``2 * (stages - 1) * microbatches`` messages of ``rows/microbatches x sequence x width``
values per pipeline; with the model's ``pipeline_block`` hook one more forward message per microbatch
and boundary, the microbatch's index, one ``int64``); the bubble (time a stage idles) is ``(stages - 1) / (microbatches + stages - 1)``
of a step for GPipe and 1F1B, and ``(p - 1) / (v * m + p - 1)`` with ``v`` stages per rank
interleaved (measured in ``bench/pipeline_bench.py``). Evaluation and ``predict`` run the stages forward only
(``pipeline_eval.py``).

What does not compose: grad accumulation and
``grad_accum="auto"`` (the schedule's microbatches replace them), fp16 loss scaling, and the
algorithms of `UNPIPELINABLE`; all refused before work starts, naming why (`check_pipeline_loop`,
`check_algorithms_for_pipeline`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from raytrain_events._torch_compat import flatten_mesh
from raytrain_events.parallel.config import PIPELINE_SCHEDULES, FSDPConfig
from raytrain_events.parallel.pipeline_split import StageModule, find_blocks, keep_stages, plan_stages

__all__ = [
    "Feed",
    "Pipeline",
    "UNPIPELINABLE",
    "check_algorithms_for_pipeline",
    "check_pipeline_loop",
    "check_pipeline_run",
    "check_pipelined_model",
    "pipeline_group",
    "pipeline_of",
    "whole_model_norm",
]

# Algorithms that cannot run under pipeline parallelism, and why (checked when the Trainer is built).
UNPIPELINABLE = {
    "MixUp": "it mixes the inputs on the first stage and the targets at the loss on the last, two ranks that draw "
    "different random mixes.",
    "CutMix": "it cuts the inputs on the first stage and mixes the targets at the loss on the last, two ranks that "
    "draw different random boxes.",
    "SAM": "its ascent step scales by the gradient norm of the parameters this rank holds, one stage's, not the "
    "model's.",
    "LayerFreezing": "it freezes the first layers of the model each rank holds, which differ by stage.",
    "ProgressiveResizing": "it changes the batch's shape between batches, but the stages' send and receive buffers "
    "keep the first batch's shapes.",
    "SeqLengthWarmup": "it changes the sequence length between batches, but the stages' send and receive buffers "
    "keep the first batch's shapes.",
}

_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
_PIPELINES: weakref.WeakKeyDictionary[torch.nn.Module, Pipeline] = weakref.WeakKeyDictionary()


def pipeline_of(model: torch.nn.Module) -> Optional[Pipeline]:
    """This rank's `Pipeline` of ``model`` (its stages), or None when it is not pipelined: evaluation
    and predict run the stages forward only through it (``pipeline_eval.py``)."""
    return _PIPELINES.get(model)


def pipeline_group(model: torch.nn.Module) -> Any:
    """The process group of ``model``'s pipeline (its stages), or None when it is not pipelined: a
    whole-model quantity (the gradient norm) is summed over it."""
    return _GROUPS.get(model)


def whole_model_norm(model: torch.nn.Module, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``norm`` (of the gradients ``model`` holds) made the whole model's: under pipeline parallelism
    combined over the pipeline's stages (one all-reduce of one number), else ``norm`` itself."""
    group = _GROUPS.get(model)
    if group is None:
        return norm
    import torch.distributed as dist

    if norm_type == float("inf"):
        total = norm.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = norm.detach().double() ** norm_type
    dist.all_reduce(total, group=group)
    return (total ** (1.0 / norm_type)).to(norm.dtype)


def check_algorithms_for_pipeline(algorithms: Sequence[Any], degree: int) -> None:
    """Raise ValueError naming each algorithm that cannot run under pipeline parallelism, and why."""
    problems = [
        f"{type(a).__name__}: {UNPIPELINABLE[type(a).__name__]}"
        for a in algorithms
        if type(a).__name__ in UNPIPELINABLE
    ]
    problems += [
        f"{type(a).__name__}: it needs backward(create_graph=True), which the pipeline's stage-by-stage backward "
        "does not run."
        for a in algorithms
        if getattr(a, "backwards_create_graph", False)
    ]
    if problems:
        raise ValueError(
            f"These algorithms cannot run with FSDPConfig(pipeline_parallel={degree}) (see docs/big-models.md for "
            "those that can):\n  " + "\n  ".join(problems)
        )


def check_pipeline_loop(config: FSDPConfig, grad_accum: Any, precision: Any, compile_model: Any = False) -> None:
    """Refuse loop options that do not compose with pipeline parallelism (`LoopOptions` calls it)."""
    pp = config.pipeline_parallel
    if compile_model:
        raise ValueError(
            f"compile={compile_model!r} with FSDPConfig(pipeline_parallel={pp}): it compiles the model's forward, which "
            "the stages never call (each runs its own blocks). Fix: compile=False; compiling stages is not built."
        )
    if grad_accum == "auto":
        raise ValueError(
            f"grad_accum='auto' with FSDPConfig(pipeline_parallel={pp}): auto microbatching cannot apply. The "
            f"schedule already splits each batch into pipeline_microbatches={config.pipeline_microbatches}, and an "
            "out-of-memory error on one stage mid-schedule leaves the other stages blocked in point-to-point "
            "receives that no retry can reach (there is no agreement between stages inside a schedule). Fix: "
            "grad_accum=1 and a fixed FSDPConfig(pipeline_microbatches=n) whose microbatch fits (more microbatches: "
            "smaller ones, and a smaller bubble)."
        )
    if grad_accum != 1:
        raise ValueError(
            f"grad_accum={grad_accum!r} with FSDPConfig(pipeline_parallel={pp}): the schedule splits each batch into "
            f"pipeline_microbatches={config.pipeline_microbatches} itself. Fix: grad_accum=1, and "
            "FSDPConfig(pipeline_microbatches=n) for more microbatches."
        )
    if getattr(precision, "value", precision) == "amp_fp16":
        raise ValueError(
            f"precision='amp_fp16' with FSDPConfig(pipeline_parallel={pp}): the loss scaler would find overflows "
            "stage by stage and skip the step on some stages only. Fix: precision='amp_bf16' or 'fp32'."
        )


def check_pipelined_model(model: torch.nn.Module, config: FSDPConfig) -> None:
    """Refuse a model the stages cannot be cut from (no protocol, a stage count that does not divide
    its blocks, parameters of its own); `RayTrainer` runs it on the driver's meta-device model."""
    _, blocks = find_blocks(model)
    plan_stages(len(blocks), config.pipeline_parallel, config.pipeline_stages_per_rank or 1, config.pipeline_split)
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"pipeline_parallel: {type(model).__name__} holds parameters of its own ({own}), outside any child module, "
            "which no single stage can own. Fix: move them into a child module (e.g. an nn.Embedding)."
        )


def check_pipeline_run(config: FSDPConfig, workers: Any, algorithms: Sequence[Any]) -> None:
    """What `RayTrainer` refuses before Ray starts under pipeline parallelism: a mesh whose product
    is not the (fixed) worker count, algorithms that cannot run."""
    if isinstance(workers, int):
        config.mesh_shape(workers)
    check_algorithms_for_pipeline(algorithms, config.pipeline_parallel)


class Feed:
    """What the stages read per batch: the microbatches (the first stage's input is a microbatch's
    index), the autocast context, and the loop's callbacks for the first stage's forward and the
    last stage's loss (set by `raytrain_events.parallel.pipeline_step.PipelineStep` each batch)."""

    def __init__(self, route: Optional[Callable[[Any], contextlib.AbstractContextManager[Any]]] = None) -> None:
        """``route``: under context parallelism, the context a stage's forward of a microbatch runs in
        (`ContextParallel.routing`: attention over the stage's context group); None: none."""
        self.route = route
        self.microbatches: List[Any] = []
        self.context: Optional[contextlib.AbstractContextManager[Any]] = None
        self.before_forward: Callable[[int], Any] = lambda index: self.microbatches[index]
        self.loss: Callable[[torch.Tensor, int], torch.Tensor] = _no_loss

    @contextlib.contextmanager
    def serving(
        self, microbatches: List[Any], context: Optional[contextlib.AbstractContextManager[Any]]
    ) -> Iterator[None]:
        """Feed ``microbatches`` as they are (no loop events: evaluation and predict), then restore
        the training feed."""
        saved = self.microbatches, self.context, self.before_forward
        self.microbatches, self.context = microbatches, context
        self.before_forward = lambda index: self.microbatches[index]
        try:
            yield
        finally:
            self.microbatches, self.context, self.before_forward = saved

    def microbatch(self, index: torch.Tensor) -> Any:
        """The first stage's microbatch ``index`` (after the loop's ``BEFORE_FORWARD``)."""
        return self.before_forward(int(index.reshape(-1)[0]))

    def loaded(self, index: torch.Tensor) -> Any:
        """Microbatch ``index`` as loaded (what ``pipeline_block`` gets on every stage); modulo the
        count: the first step's shape inference hands the later stages an uninitialised index."""
        return self.microbatches[int(index.reshape(-1)[0]) % len(self.microbatches)]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.context if self.context is not None else contextlib.nullcontext()

    def attention(self, index: Optional[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
        """What a stage's blocks run in for microbatch ``index`` (`route`; nothing without one). A stage
        that is not told the index (no ``pipeline_block``) takes the first microbatch's: the parts of a
        batch share their sequence positions (microbatches split rows, not the sequence)."""
        if self.route is None or not self.microbatches:
            return contextlib.nullcontext()
        return self.route(self.loaded(index) if index is not None else self.microbatches[0])

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, int(target.reshape(-1)[0]))


def _no_loss(output: torch.Tensor, index: int) -> torch.Tensor:
    raise RuntimeError("The pipeline ran before the loop set its loss (Feed.loss).")


class Pipeline:
    """This rank's part of the pipelines: its stages (pruned from ``model`` in place), their schedule
    and the pipeline's process group. Built by `Parallel.wrap` before it shards each of ``modules``
    (`raytrain_events.parallel.wrap.shard_stages`) and materialises them."""

    def __init__(self, model: torch.nn.Module, config: FSDPConfig, mesh: Any, context: Any = None) -> None:
        """``context``: the rank's `ContextParallel` under context parallelism (its stages cut every
        microbatch and split their attention over its group), else None."""
        pp_mesh = mesh["pipeline"]
        self.config, self.context = config, context
        self.device: Optional[torch.device] = None  # set by `build_schedule`
        self.group = pp_mesh.get_group()
        self.rank = pp_mesh.get_local_rank()
        check_pipelined_model(model, config)
        _, blocks = find_blocks(model)
        per_rank = config.pipeline_stages_per_rank or 1
        self.layout = plan_stages(len(blocks), config.pipeline_parallel, per_rank, config.pipeline_split)
        held, edges = keep_stages(model, self.layout, self.rank)
        self.feed = Feed(None if context is None else context.routing)
        last = self.layout.stages - 1
        self.stage_indices = sorted(held)
        self.modules: List[StageModule] = [
            StageModule(model, held[s], edges[0] if s == 0 else None, edges[1] if s == last else None, self.feed)
            for s in self.stage_indices
        ]
        self.has_first = 0 in held
        self.has_last = last in held
        self.microbatches: int = config.pipeline_microbatches or config.pipeline_parallel
        _GROUPS[model] = self.group
        _PIPELINES[model] = self
        self.schedule: Any = None
        # The ranks at this rank's pipeline (and tensor) coordinate across the data-parallel dimensions:
        # the last stage's metrics sync over them (made here, on every rank: a new group is collective).
        if config.replicate > 1:
            self.data_group: Any = flatten_mesh(mesh["replicate", "shard"], "replicate_shard").get_group()
        else:
            self.data_group = mesh["shard"].get_group()

    def check_batch(self, batch: Any) -> None:
        """Refuse a packed batch (``document_ids``) when the model's blocks cannot get it: without the
        model's ``pipeline_block`` hook a stage calls ``block(hidden)``, and its documents would
        attend to each other in silence."""
        packed = isinstance(batch, Mapping) and ("document_ids" in batch or "cu_seqlens" in batch)
        if packed and not self.modules[0].passes_index:
            raise ValueError(
                "A packed batch (document_ids) under FSDPConfig(pipeline_parallel=...), but the model has no "
                "pipeline_block(block, hidden, microbatch) method: its stages call block(hidden), so the document "
                "masks would not reach the blocks and documents would attend to each other. Fix: define "
                "pipeline_block on the model to call a block with the microbatch's document ids, e.g. "
                "`return block(hidden, microbatch.get('document_ids'))` (examples/transformer_lm.py does)."
            )

    def split(self, microbatch: Any) -> Any:
        """This rank's part of a training microbatch: its context part under context parallelism."""
        return microbatch if self.context is None else self.context.split(microbatch)

    def build_schedule(self, device: torch.device) -> None:
        """The schedule over this rank's `PipelineStage`s (after the parameters are materialised)."""
        from torch.distributed import pipelining

        self.device = device
        stages = [
            pipelining.PipelineStage(module, index, self.layout.stages, device, group=self.group)
            for module, index in zip(self.modules, self.stage_indices)
        ]
        class_name, interleaved = PIPELINE_SCHEDULES[self.config.pipeline_schedule]
        schedule_class = getattr(pipelining, class_name)
        # scale_grads=False: the loss of each microbatch is weighted by its share of the batch's
        # samples (as the loop's grad accumulation), so the gradient is the batch mean without it.
        kwargs: Dict[str, Any] = dict(
            n_microbatches=self.microbatches, loss_fn=self.feed.compute_loss, scale_grads=False
        )
        self.schedule = schedule_class(stages, **kwargs) if interleaved else schedule_class(stages[0], **kwargs)

    def step(self) -> List[torch.Tensor]:
        """Run the batch in ``self.feed.microbatches`` through the schedule (forward, loss, backward);
        the last stage's microbatch losses (empty on other ranks)."""
        index = torch.arange(self.microbatches)
        losses: List[torch.Tensor] = []
        args = (index,) if self.has_first else ()
        target = index if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        return losses
