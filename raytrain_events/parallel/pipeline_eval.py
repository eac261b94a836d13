"""Evaluation and predict under pipeline parallelism: the stages run forward only, and what the
last stage computes is shared over the pipeline.

`forward_only` runs one eval (or predict) batch through the stages: the batch is split into the
pipeline's microbatches (``pipeline_microbatches``; fewer when the batch has fewer rows), and each
rank runs its stages' modules microbatch by microbatch (each microbatch through this rank's stages
in order), receiving a stage's input from the rank of the stage before and sending its output to
the rank of the next, point to point within the pipeline. Sends are asynchronous and each rank
works in the same (microbatch, stage) order, so a stage starts the next microbatch while the next
stage runs this one (GPipe's forward) and nothing waits in a cycle. Each activation goes with a
header of its shape and dtype, so eval batches need not have the training batches' shape (the
training schedule's buffers keep the first batch's shapes; it is not used here). A stage's FSDP
gathers its parameters once per call, so the data-parallel ranks of a stage must run as many
microbatches: they do when their eval batches have at least ``pipeline_microbatches`` rows (or the
same rows), as equal splits (`DistributedSampler`, Ray's ``split(equal=True)``) give them.

The model's outputs exist on the last stage: the loop updates the metrics there, computes them over
the last stage's data-parallel ranks (`Pipeline.data_group`, each batch counted once) and
`share_from_last` broadcasts the values over the pipeline, so every rank returns and logs the same.
Predict broadcasts each batch's outputs over the pipeline (when they are returned), so every rank
returns its pipeline's outputs, as without PP every rank returns its own.

Cost per eval batch and pipeline: ``(stages - 1) * microbatches`` activation messages
(``rows/microbatches x sequence x width`` values, plus a 10-integer header each), no backward and no
bubble beyond GPipe's forward one; per evaluator one broadcast of the metric values over the
pipeline; predict one broadcast of each batch's outputs (on the CPU) over the pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import torch

from raytrain_events.parallel.pipeline import Pipeline

__all__ = ["forward_only", "share_from_last"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # dtype index, dimensions, shape


def forward_only(
    pipeline: Pipeline,
    batch: Any,
    spec: Any,
    autocast: Optional[contextlib.AbstractContextManager[Any]],
) -> Optional[torch.Tensor]:
    """``batch`` through the model's stages, forward only (under the caller's ``torch.no_grad``);
    the model's outputs on the last stage's ranks, None on the others. ``spec``: the batch's
    `DataSpec` (its ``split_batch`` and sample count cut the microbatches)."""
    pipeline.check_batch(batch)
    rows = spec.get_num_samples_in_batch(batch)
    count = max(1, min(pipeline.microbatches, int(rows)))
    parts = spec.split_batch(batch, count) if count > 1 else [batch]
    last, degree = pipeline.layout.stages - 1, pipeline.layout.degree
    device = pipeline.device or torch.device("cpu")
    outputs: List[torch.Tensor] = []
    pending: List[Any] = []  # (work, tensors it sends): kept alive until the sends complete
    with pipeline.feed.serving(parts, autocast):
        for index in range(len(parts)):
            for module, stage in zip(pipeline.modules, pipeline.stage_indices):
                at = torch.tensor([index], device=device)
                if stage == 0:
                    y = module(at)
                else:  # a model with pipeline_block: this rank knows the index, only the hidden state travels
                    x = _receive(pipeline, (stage - 1) % degree, device)
                    y = module(x, at) if module.passes_index else module(x)
                if isinstance(y, tuple):  # (hidden, index) of a stage but the last
                    y = y[0]
                if stage == last:
                    outputs.append(y)
                else:
                    pending.extend(_send(pipeline, y, (stage + 1) % degree, device))
    for work, _ in pending:
        work.wait()
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _send(pipeline: Pipeline, value: Any, to: int, device: torch.device) -> List[Any]:
    import torch.distributed as dist

    if not isinstance(value, torch.Tensor) or value.dtype not in _DTYPES or value.dim() > _MAX_DIMS:
        raise TypeError(
            f"A pipeline stage's output must be one tensor of at most {_MAX_DIMS} dimensions and a dtype among "
            f"{[str(d) for d in _DTYPES]}; got {type(value).__name__} "
            f"{getattr(value, 'dtype', '')} {tuple(getattr(value, 'shape', ()))}."
        )
    value = value.detach().contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(value.dtype), value.dim()
    header[2 : 2 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    header = header.to(device)
    return [
        (dist.isend(header, group=pipeline.group, group_dst=to), header),
        (dist.isend(value, group=pipeline.group, group_dst=to), value),
    ]


def _receive(pipeline: Pipeline, source: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=pipeline.group, group_src=source)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    shape = [int(n) for n in header[2 : 2 + dims].tolist()]
    value = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(value, group=pipeline.group, group_src=source)
    return value


def share_from_last(pipeline: Pipeline, value: Any) -> Any:
    """``value`` as the last stage's rank of this pipeline has it (its metric values, or a predict
    batch's outputs on the CPU), on every rank of the pipeline: one broadcast over the pipeline."""
    import torch.distributed as dist

    holder: List[Any] = [value if pipeline.has_last else None]
    device = pipeline.device if pipeline.device is not None and pipeline.device.type == "cuda" else None
    dist.broadcast_object_list(holder, group=pipeline.group, group_src=pipeline.layout.degree - 1, device=device)
    return holder[0]


def cpu_values(values: Dict[str, Any]) -> Dict[str, Any]:
    """Metric values with tensors on the CPU (what `share_from_last` sends)."""
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
