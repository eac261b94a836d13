"""Rank functions for the safetensors tests: a wide FSDP run that saves, and loading an export."""

from __future__ import annotations

from typing import Any, Dict

import torch

from raytrain_events import Trainer
from raytrain_events.checkpoint import CheckpointConfig
from raytrain_events.models import ClassifierModel
from tests.parallel.workloads import Block, full_model_state, make_loader, make_model

WIDE = 256  # 256 KiB per block weight: tensors well above the bookkeeping of an export


def wide_model() -> ClassifierModel:
    torch.manual_seed(0)
    layers = [Block(WIDE) for _ in range(4)] + [torch.nn.Linear(WIDE, 5)]
    return ClassifierModel(torch.nn.Sequential(*layers), num_classes=5)


def save_wide(rank: int, world_size: int, folder: str) -> Dict[str, torch.Tensor]:
    """One FSDP batch of the wide model, saved at the end; the full model state."""
    model = wide_model()
    trainer = Trainer(
        model=model,
        train_dataloader=make_loader(rank, n=8, width=WIDE),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        parallelism={"shard_modules": ["Block"]},
        checkpoint=CheckpointConfig(save_folder=folder, save_interval="1ba", lock_run_dir=False, async_save=False),
    )
    trainer.fit()
    out = full_model_state(trainer.state.model)
    trainer.close()
    return out


def load_export(rank: int, world_size: int, directory: str, parallelism: Any, meta: bool) -> Dict[str, Any]:
    """A Trainer on ``parallelism`` (model built on meta if ``meta``) filled from the export."""
    from raytrain_events.checkpoint.dcp.safetensors_io import load_safetensors

    torch.manual_seed(123)  # different from the exported weights
    with torch.device("meta") if meta else torch.device("cpu"):
        model = make_model() if not meta else _meta_model()
    trainer = Trainer(
        model=model,
        train_dataloader=make_loader(rank),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        parallelism=parallelism,
    )
    loaded = load_safetensors(trainer.state.model, directory)
    return {
        "loaded": loaded,
        "state": full_model_state(trainer.state.model),
        "sharded": any(type(p).__name__ == "DTensor" for p in trainer.state.model.parameters()),
    }


def _meta_model() -> ClassifierModel:
    layers = [Block(16) for _ in range(3)] + [torch.nn.Linear(16, 5)]
    return ClassifierModel(torch.nn.Sequential(*layers), num_classes=5)


def wide_sizes(world_size: int) -> Dict[str, int]:
    """Bytes of the wide model, of one rank's FSDP share (dim 0 padded) and of its largest layer."""
    with torch.device("meta"):
        model = wide_model()
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    share = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) * p.element_size() for p in params)
    layer = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
        if any(True for _ in m.parameters(recurse=False))
    )
    return {"model": total, "share": share, "layer": layer}


def start_from_export(rank: int, world_size: int, directory: str, folder: str) -> Dict[str, Any]:
    """FSDP on this rank, the wide model built on the meta device, started with
    ``CheckpointConfig(load_from=directory)`` (a safetensors export); the peak bytes of tensor storage
    while it was set up, its full starting state, and that it trains a batch from there."""
    from tests.parallel.alloc import PeakStorageBytes

    with PeakStorageBytes() as counter:
        with torch.device("meta"):
            model = wide_model()
        trainer = Trainer(
            model=model,
            train_dataloader=make_loader(rank, n=8, width=WIDE),
            max_duration="1ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            parallelism={"shard_modules": ["Block"]},
            checkpoint=CheckpointConfig(
                load_from=directory, save_folder=folder, save_interval=None, save_final=False, lock_run_dir=False
            ),
        )
        peak = counter.peak
    start = full_model_state(trainer.state.model)
    timestamp = trainer.state.timestamp.state_dict()
    trainer.fit()
    trainer.close()
    return {"peak": peak, "start": start, "timestamp": timestamp, "batches": trainer.state.timestamp.batch.value}
