"""Rank functions for deferred init under tensor and context parallelism: the example transformer
built on the meta device vs built eagerly, under ``FSDPConfig(shard_modules=["Block"],
tensor_parallel=2)`` or ``context_parallel=2`` (the 2 consecutive ranks of a group load the same rows)."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from tests.parallel.alloc import PeakStorageBytes
from tests.parallel.workloads import full_model_state

LAYOUTS = {
    "tp": {"shard_modules": ["Block"], "tensor_parallel": 2},
    "cp": {"shard_modules": ["Block"], "context_parallel": 2},
}


def build(meta: bool) -> torch.nn.Module:
    """The same seed and construction order; ``meta``: on the meta device (no storage)."""
    from examples.transformer_lm import TransformerLM

    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return TransformerLM(vocab=64, width=64, heads=4, depth=3, length=16)


def _local_bytes(model: torch.nn.Module) -> int:
    return sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())


def set_up(rank: int, world_size: int, meta: bool, layout: str) -> Dict[str, Any]:
    from examples.transformer_lm import random_tokens

    loader = DataLoader(random_tokens(32, seed=rank // 2), batch_size=4)  # the data-parallel rank's rows
    with PeakStorageBytes() as counter:
        model = build(meta)
        trainer = Trainer(
            model=model,
            train_dataloader=loader,
            max_duration="2ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
            parallelism=LAYOUTS[layout],
            seed=7,  # per-rank seeding after the factory must not change the initial weights
        )
        peak = counter.peak
    local = _local_bytes(trainer.state.model)
    start = full_model_state(trainer.state.model)
    trainer.fit()
    return {"peak": peak, "local": local, "start": start, "end": full_model_state(trainer.state.model)}


def eager_and_deferred(rank: int, world_size: int, layout: str = "tp") -> Dict[str, Any]:
    """Both arms on this rank: peaks, this rank's parameter bytes, start and end states."""
    return {name: set_up(rank, world_size, meta, layout) for name, meta in (("eager", False), ("deferred", True))}
