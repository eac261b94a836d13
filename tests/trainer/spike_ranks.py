"""A rank job for tests/trainer/test_gloo_ranks.py: `SpikeGuard` on spawned gloo ranks, a NaN row planted
on the last rank only, so the other ranks roll back on the agreement alone."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.callbacks import SpikeGuard
from raytrain_events.dist import TorchDist
from raytrain_events.models import ClassifierModel

ROWS, BATCH, PLANTED = 160, 8, 83  # 20 batches per rank; local row 83 is in batch 11 (1-based)


def train_spike(rank: int, world_size: int) -> dict:
    logging.getLogger("raytrain_events").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS, 4, generator=g)
    y = (x[:, 0] > 0).long()
    if rank == world_size - 1:
        x[PLANTED] = float("nan")  # its loss is NaN on this rank; DDP's all-reduce spreads NaN gradients to all
    rows = [{"x": x[i], "y": y[i]} for i in range(ROWS)]
    torch.manual_seed(0)
    model = ClassifierModel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), num_classes=2
    )
    guard = SpikeGuard(snapshot_interval=4, warmup=3, grad_zscore=None)  # each rank judges its own loss
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=BATCH),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[guard],
        dist=TorchDist(torch.device("cpu")),
    )
    state = trainer.fit()
    return {
        "rollbacks": guard.rollbacks,
        "skips": guard.skips.state_dict()["ranges"],
        "trained": guard.trained(state),
        "sample": int(state.timestamp.sample),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
