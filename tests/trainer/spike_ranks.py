"""Rank jobs for tests/trainer/test_gloo_ranks.py: `SpikeGuard` on spawned gloo ranks, a NaN row planted
on the last rank only, so the other ranks roll back on the agreement alone; a mixture's quarantine, whose
dropped rows, tokens and sources every rank counts alike from the loop's per-batch sum."""

from __future__ import annotations

import logging
import tempfile
from typing import Any, Dict, List

import torch
from mixture_ranks import GLOBAL_BATCH, MIXTURE, SEED, SOURCES, _Model, _Source
from torch.utils.data import DataLoader

from raytrain_events import Callback, DataSpec, Trainer
from raytrain_events.callbacks import SpikeGuard
from raytrain_events.core.quarantine import Quarantine
from raytrain_events.data.mixture_loader import MixtureLoader
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


class _Ided:
    """A mixture source (`mixture_ranks._Source`) whose rows carry a 1-d row key: the rows of the sources before
    it + the row (``SpikeGuard(row_ids="mixture")``)."""

    def __init__(self, source: Any, offset: int) -> None:
        self.source, self.offset = source, offset

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, row: int) -> Dict[str, torch.Tensor]:
        return {**self.source[row], "rid": torch.tensor(self.offset + row)}


class _Dropped(Callback):
    """This rank's rows as read (before the quarantine drops any): (rid, tokens)."""

    def __init__(self) -> None:
        self.read: List[List[int]] = []

    def after_dataloader(self, state: Any, logger: Any) -> None:
        self.read.extend([int(i), int(n)] for i, n in zip(state.batch["rid"], state.batch["len"]))


def quarantined_ids() -> List[int]:
    """Every 7th row of the mixture's rows, by row id: the quarantine the ranks load from a file."""
    return list(range(3, sum(SOURCES.values()), 7))


def train_quarantine(rank: int, world_size: int) -> dict:
    """A `Mixture` with a quarantine file on every rank: this rank's rows as read, and ``State.skipped``."""
    del rank
    names = MIXTURE.names  # the order the row ids number the sources in (`Mixture.names`: sorted)
    offsets = [sum(SOURCES[n] for n in names[:i]) for i in range(len(names))]
    datasets = {n: _Ided(_Source(i, SOURCES[n]), offsets[i]) for i, n in enumerate(names)}
    loader = MixtureLoader(
        MIXTURE, datasets, batch_size=GLOBAL_BATCH // world_size, tokens_of_row=lambda row: int(row["len"])
    )
    quarantine = Quarantine()
    for rid in quarantined_ids():
        quarantine.add(rid, 0, 0)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fh.write(quarantine.dumps())
    guard, dropped, model = SpikeGuard(row_key="rid", row_ids="mixture", quarantine_from=fh.name), _Dropped(), _Model()
    state = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[dropped, guard],
        dist=TorchDist(torch.device("cpu")),
        seed=SEED,
    ).fit()
    return {"read": dropped.read, "skipped": state.skipped.state_dict(), "trained": guard.trained(state)}
