"""Rank functions for the deferred-init tests: a model built on the meta device vs built eagerly."""

from __future__ import annotations

from typing import Any, Dict

import torch

from raytrain_events import Trainer
from raytrain_events.models import ClassifierModel
from tests.parallel.alloc import PeakStorageBytes
from tests.parallel.workloads import Block, full_model_state, make_loader

WIDTH, DEPTH, CLASSES = 64, 4, 5


def build(meta: bool) -> ClassifierModel:
    """The same seed and construction order; ``meta``: on the meta device (no storage)."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        layers = [Block(WIDTH) for _ in range(DEPTH)] + [torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, CLASSES)]
        return ClassifierModel(torch.nn.Sequential(*layers), num_classes=CLASSES)


def model_bytes(world_size: int = 1) -> Dict[str, int]:
    """Bytes of the whole model, of one rank's share of it (FSDP pads dim 0 to a multiple of the
    world size) and of its largest layer (module with direct parameters)."""
    model = build(meta=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    share = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())
    layer = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
        if any(True for _ in m.parameters(recurse=False))
    )
    return {"model": total, "share": share, "layer": layer}


def set_up(rank: int, meta: bool, parallelism: Any, train: str) -> Dict[str, Any]:
    loader = make_loader(rank, width=WIDTH, classes=CLASSES)
    with PeakStorageBytes() as counter:
        model = build(meta)
        trainer = Trainer(
            model=model,
            train_dataloader=loader,
            max_duration=train,
            optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
            parallelism=parallelism,
            seed=7,  # per-rank seeding after the factory must not change the initial weights
        )
        peak = counter.peak
    start = full_model_state(trainer.state.model)
    trainer.fit()
    return {"peak": peak, "start": start, "end": full_model_state(trainer.state.model)}


def eager_and_deferred(rank: int, world_size: int, arms: Any, train: str = "2ba") -> Dict[str, Any]:
    """Each arm (name -> (meta, parallelism)) built, trained ``train``; peaks, start and end states."""
    return {name: set_up(rank, meta, parallelism, train) for name, (meta, parallelism) in arms.items()}
