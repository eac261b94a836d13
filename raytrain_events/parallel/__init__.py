"""Data parallelism for the `Trainer`: DDP (default), FSDP2 sharding or HSDP (`FSDPConfig`,
``replicate=k``), tensor parallelism (``tensor_parallel=t``, ``tensor_parallel.py``) and context
parallelism (``context_parallel=c``, ``context_parallel.py``) and pipeline parallelism
(``pipeline_parallel=p``, ``pipeline.py``), alone or together on one mesh ``(replicate, shard,
pipeline, context, tensor)`` (``config.py``; wrapping in ``wrap.py``); which world sizes
fit (``world.py``); deferred init of meta-device models (``deferred_init.py``); float8 (``float8.py``).

Files:

* ``config.py``: How the model is spread over the ranks: `FSDPConfig`, and parsing of the
  ``parallelism`` option.
* ``context_parallel.py``: Context parallelism (CP): split each row's sequence over a group of ``c``
  ranks, so that sequences too long for one device's activations can train
  (``FSDPConfig(context_parallel=c)``).
* ``deferred_init.py``: Deferred initialisation: a model built on the meta device is sharded first,
  then materialised.
* ``document_attention.py``: Document masks: block-causal attention over packed sequences, so no
  token attends across a document.
* ``float8.py``: Float8 training through torchao: which GPUs and packages support it, and the
  conversion.
* ``pipeline.py``: Pipeline parallelism (PP) on the mesh: this rank's stages, FSDP per stage, the
  ``torch.distributed.pipelining`` schedule, and what does not compose with it.
* ``pipeline_eval.py``: Evaluation and predict under pipeline parallelism: the stages run forward
  only, and what the last stage computes is shared over the pipeline.
* ``pipeline_split.py``: Cut a model into pipeline stages: which blocks each stage holds, and the
  part of the model one rank keeps.
* ``pipeline_step.py``: The loop's batch under pipeline parallelism: the schedule runs forward, loss
  and backward, and the loop's events fire where the work happens.
* ``oom_agreement.py``: Out-of-memory agreement inside FSDP's forward and backward, for
  ``grad_accum="auto"`` under FSDP.
* ``tensor_parallel.py``: Tensor parallelism (TP): split each layer's matrices over a group of
  ranks, through DTensor's ``parallelize_module``, before FSDP shards what is left over the
  data-parallel dimension.
* ``world.py``: Which worker counts a parallelism can use: rules that need no torch.
* ``wrap.py``: Wrap the model for data parallelism: DDP (a replica per rank) or FSDP2 (sharded),
  and say which algorithms cannot run sharded.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:
    from raytrain_events.parallel.config import FSDPConfig, ParallelismSpec, parse_parallelism
    from raytrain_events.parallel.tensor_parallel import apply_tensor_parallel
    from raytrain_events.parallel.wrap import Parallel, apply_fsdp, check_algorithms_for_sharding, is_sharded_module

__all__ = [
    "FSDPConfig",
    "Parallel",
    "ParallelismSpec",
    "apply_fsdp",
    "apply_tensor_parallel",
    "check_algorithms_for_sharding",
    "is_sharded_module",
    "parse_parallelism",
]

# Loaded on first use, so that `parallel.world` (torch-free) can be imported alone.
_LAZY = {
    "FSDPConfig": "raytrain_events.parallel.config",
    "ParallelismSpec": "raytrain_events.parallel.config",
    "parse_parallelism": "raytrain_events.parallel.config",
    "apply_tensor_parallel": "raytrain_events.parallel.tensor_parallel",
    "Parallel": "raytrain_events.parallel.wrap",
    "apply_fsdp": "raytrain_events.parallel.wrap",
    "check_algorithms_for_sharding": "raytrain_events.parallel.wrap",
    "is_sharded_module": "raytrain_events.parallel.wrap",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())
