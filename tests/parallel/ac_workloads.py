"""Rank functions for the activation-checkpointing measurement (importable by spawned ranks and bench/).

`SavedActivations` counts the bytes autograd saves for backward during each forward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once): with nothing freed before
backward, that sum is the forward's peak of activation memory. Under ``activation_checkpointing``
a checkpointed block saves only its input (the recompute in backward keeps one block's tensors
at a time, under torch's own hooks: not counted here).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.core.callback import Callback

SIZES = dict(width=64, heads=4, depth=4, length=64)  # the transformer the test and the bench train


class StepTimes(Callback):
    """Seconds from BATCH_START to BATCH_END of each batch on this rank (the bench scripts' step time)."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.start = 0.0

    def batch_start(self, state: Any, logger: Any) -> None:
        self.start = time.perf_counter()

    def batch_end(self, state: Any, logger: Any) -> None:
        self.times.append(time.perf_counter() - self.start)


def timed_fit(trainer: Trainer, timer: StepTimes, saved: SavedActivations) -> Dict[str, Any]:
    """Fit, close, and return the median step after the first two and the largest forward's saved bytes."""
    trainer.fit()
    trainer.close()
    return {"step_s": statistics.median(timer.times[2:]), "saved": max(saved.saved)}


class SavedActivations(Callback):
    """Per batch: the bytes saved for backward by the forward (``saved``), the loss, and (first
    batch) every parameter's full gradient after backward."""

    def __init__(self) -> None:
        self.saved: List[int] = []
        self.losses: List[float] = []
        self.grads: Dict[str, torch.Tensor] = {}
        self._hooks: Optional[Any] = None
        self._storages: set = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._storages:
            self._storages.add(key)
            self.saved[-1] += storage.nbytes()
        return tensor

    def before_forward(self, state: Any, logger: Any) -> None:
        self.saved.append(0)
        self._storages = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def after_forward(self, state: Any, logger: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(None, None, None)
        self._hooks, self._storages = None, set()

    def after_backward(self, state: Any, logger: Any) -> None:
        self.losses.append(float(state.loss.detach()))
        if not self.grads:
            for name, param in state.model.named_parameters():
                grad = param.grad
                self.grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def ac_trainer(
    rank: int, checkpointing: bool, batches: int, callbacks: Any = (), sizes: Optional[Dict[str, int]] = None
) -> Trainer:
    """FSDP (one unit per Block) on the transformer (`SIZES` unless ``sizes``), with or without
    ``activation_checkpointing``; batches of 8 rows."""
    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events.parallel import FSDPConfig

    sizes = dict(SIZES, **(sizes or {}))
    torch.manual_seed(0)
    model = TransformerLM(**sizes)
    rows = random_tokens(8 * batches, length=sizes["length"], seed=100 + rank)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=8),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        parallelism=FSDPConfig(shard_modules=["Block"], activation_checkpointing=checkpointing),
        callbacks=list(callbacks),
    )


def measure_saved_activations(rank: int, world_size: int) -> Dict[str, Any]:
    """Train 2 batches without and with activation checkpointing; what `SavedActivations` saw."""
    out: Dict[str, Any] = {}
    for name, checkpointing in (("plain", False), ("ac", True)):
        seen = SavedActivations()
        trainer = ac_trainer(rank, checkpointing, 2, [seen])
        trainer.fit()
        trainer.close()
        out[name] = {"saved": seen.saved, "losses": seen.losses, "grads": seen.grads}
    return out
