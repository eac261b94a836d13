"""A model that runs out of (simulated) device memory above a microbatch size, for auto microbatching tests.

`OOMModel` raises ``torch.OutOfMemoryError`` in forward when a microbatch has more rows than
``limit`` (as a GPU would, but on CPU), and counts its forward calls. `train_auto` is the job that
spawned gloo ranks run (tests/trainer/gloo_ranks.py): each rank may have its own limit.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.core.logger import LoggerDestination
from raytrain_events.dist import TorchDist

ROWS, BATCH = 48, 16


class OOMModel(torch.nn.Module):
    """Linear -> ReLU -> Linear with cross-entropy; forward fails above ``limit`` rows."""

    def __init__(self, limit: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights everywhere
        self.body = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)
        self.limit = limit
        self.forward_rows: List[int] = []  # rows of every forward call, failed ones included

    def forward(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = len(batch[0])
        self.forward_rows.append(rows)
        hidden = torch.relu(self.body(batch[0]))
        if self.limit is not None and rows > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {rows} rows > {self.limit}")
        return self.head(hidden)

    def loss(self, outputs: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, batch[1])


def dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (ROWS,), generator=g))


def make_trainer(model: Optional[OOMModel] = None, *, seed: int = 0, epochs: int = 2, **kwargs: Any) -> Trainer:
    """The tests' Trainer: ``model`` (a fresh `OOMModel` by default) for ``epochs`` on `dataset(seed)`,
    SGD with momentum; ``kwargs`` go to `Trainer` (grad_accum, compile, algorithms, dist, ...)."""
    model = model if model is not None else OOMModel()
    return Trainer(
        model=model,
        train_dataloader=DataLoader(dataset(seed=seed), batch_size=BATCH),
        max_duration=f"{epochs}ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        **kwargs,
    )


def weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Recorder(LoggerDestination):
    """Keeps every logged metric."""

    def __init__(self) -> None:
        self.metrics: List[Dict[str, Any]] = []

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        self.metrics.append(dict(metrics))


def train_auto(rank: int, world_size: int, *, limits: Sequence[Optional[int]], grad_accum: Any = "auto") -> dict:
    """Two epochs on this rank's data with this rank's memory limit; returns what the test compares."""
    model = OOMModel(limits[rank])
    state = make_trainer(model, seed=rank, grad_accum=grad_accum, dist=TorchDist()).fit()
    return {
        "grad_accum": state.grad_accum,
        "timestamp": state.timestamp.state_dict(),
        "forward_rows": model.forward_rows,
        "weights": weights(model),
    }


def train_compiled(rank: int, world_size: int, *, compiled: bool) -> dict:
    """Two epochs under DDP with the model compiled through a graph-counting backend (or eager)."""
    graphs: List[int] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    model = OOMModel()
    make_trainer(model, seed=rank, compile={"backend": backend} if compiled else False, dist=TorchDist()).fit()
    return {"graphs": len(graphs), "weights": weights(model)}


def train_sam(rank: int, world_size: int, *, rho: float, grad_accum: int = 1) -> dict:
    """Two epochs of SGD + SAM under DDP on this rank's data; returns the weights."""
    from raytrain_events.algorithms import SAM

    model = OOMModel()
    make_trainer(model, seed=rank, algorithms=[SAM(rho=rho)], grad_accum=grad_accum, dist=TorchDist()).fit()
    return {"weights": weights(model)}


def train_profiled(rank: int, world_size: int, *, folder: str) -> dict:
    """Three epochs (9 batches) under DDP with a `Profiler` of 1 wait, 1 warmup, 2 active batches, 2 cycles."""
    from raytrain_events.callbacks import Profiler

    profiler = Profiler(folder, wait="1ba", warmup=1, active="2ba", repeat=2)
    make_trainer(seed=rank, epochs=3, callbacks=[profiler], dist=TorchDist()).fit()
    return {"traces": list(profiler.traces)}
