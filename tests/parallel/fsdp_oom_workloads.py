"""Rank functions for auto microbatching under FSDP: one rank runs out of (simulated) device memory
inside one layer's forward or backward, at a chosen batch, while its microbatches are too large."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from raytrain_events import Callback, Trainer
from raytrain_events.dist import TorchDist
from tests.parallel.workloads import full_model_state, make_loader, make_model


class InjectOOM(Callback):
    """Raises ``torch.OutOfMemoryError`` in layer ``layer``'s forward (or its backward) at batch ``step``
    while a microbatch has more than ``limit`` rows: a GPU running out of activation memory there."""

    def __init__(self, layer: int, step: int, limit: int, where: str) -> None:
        self.layer, self.step, self.limit, self.where = layer, step, limit, where
        self.batch = -1
        self.raised: List[int] = []  # the rows of each microbatch that raised

    def fit_start(self, state: Any, logger: Any) -> None:
        module = state.model.module[self.layer]  # ClassifierModel(Sequential(...))
        module.register_forward_hook(self._forward)

    def batch_start(self, state: Any, logger: Any) -> None:
        self.batch = int(state.timestamp.batch)

    def _forward(self, module: Any, args: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
        rows = len(args[0])
        if self.batch != self.step or rows <= self.limit or not torch.is_grad_enabled():
            return None
        if self.where == "forward":
            self.raised.append(rows)
            raise torch.OutOfMemoryError(f"simulated: {rows} rows > {self.limit} in forward")

        def in_backward(grad: torch.Tensor) -> torch.Tensor:
            self.raised.append(rows)
            raise torch.OutOfMemoryError(f"simulated: {rows} rows > {self.limit} in backward")

        output.register_hook(in_backward)
        return None


class SwitchGradAccum(Callback):
    """The reference for an error at a later batch: the same run, told to use ``value`` microbatches
    from batch ``step`` on (what the retry settles on), with no error at all."""

    def __init__(self, step: int, value: int) -> None:
        self.step, self.value = step, value

    def batch_start(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.step:
            state.grad_accum = self.value


def train_fsdp_auto(
    rank: int,
    world_size: int,
    grad_accum: Any,
    oom_rank: int = -1,
    where: str = "forward",
    step: int = 0,
    switch_at: Optional[int] = None,
) -> Dict[str, Any]:
    """Six batches of 8 rows under FSDP (each Block a unit); rank ``oom_rank`` fails in Block 1 at batch
    ``step`` with microbatches above 2 rows (``switch_at``: no error, 4 microbatches from that batch on).
    Returns the final count, the checks run, the Timestamp and the full parameters."""
    model = make_model()
    callbacks: List[Callback] = [InjectOOM(layer=1, step=step, limit=2, where=where)] if rank == oom_rank else []
    if switch_at is not None:
        callbacks.append(SwitchGradAccum(switch_at, 4))
    trainer = Trainer(
        model=model,
        train_dataloader=make_loader(rank),
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        grad_accum=grad_accum,
        parallelism={"shard_modules": ["Block"]},
        callbacks=callbacks,
        dist=TorchDist(torch.device("cpu")),
    )
    state = trainer.fit()
    auto = trainer._auto
    return {
        "grad_accum": state.grad_accum,
        "raised": [r for c in callbacks if isinstance(c, InjectOOM) for r in c.raised],
        "checks": auto.agreement.checks if auto is not None and auto.agreement is not None else 0,
        "units": len(auto.agreement.units) if auto is not None and auto.agreement is not None else 0,
        "timestamp": state.timestamp.state_dict(),
        "model": full_model_state(state.model),
        "sharded": any(type(p).__name__ == "DTensor" for p in state.model.parameters()),
    }


def fsdp_auto_runs(rank: int, world_size: int, runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Several `train_fsdp_auto` runs one after another on the same ranks (one spawn)."""
    return [train_fsdp_auto(rank, world_size, **run) for run in runs]
