"""Tiny models, data and recorders shared by the library's tests in ``tests/algorithms/``, ``tests/callbacks/``,
``tests/loggers/`` and ``tests/schedulers/`` (imported as a plain module: ``tests/`` is on the path)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Algorithm, Callback, Event, LoggerDestination, Trainer
from raytrain_events.models import ClassifierModel


def classifier(in_dim: int = 4, num_classes: int = 3, hidden: Optional[int] = None) -> ClassifierModel:
    if hidden is None:
        net = torch.nn.Linear(in_dim, num_classes)
    else:
        net = torch.nn.Sequential(
            torch.nn.Linear(in_dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, num_classes),
        )
    return ClassifierModel(net, num_classes=num_classes)


def image_classifier(channels: int = 3, num_classes: int = 3) -> ClassifierModel:
    net = torch.nn.Sequential(
        torch.nn.Conv2d(channels, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, num_classes),
    )
    return ClassifierModel(net, num_classes=num_classes)


def loader(n: int = 32, batch_size: int = 8, shape=(4,), num_classes: int = 3, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def trainer(model=None, *, lr: float = 0.1, optimizer=None, **kwargs) -> Trainer:
    model = model if model is not None else classifier()
    kwargs.setdefault("train_dataloader", loader())
    kwargs.setdefault("max_duration", "1ep")
    kwargs.setdefault("seed", 0)
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(model=model, optimizers=optimizer, **kwargs)


class Record(Callback):
    """Calls ``fns[event](state)`` at each of its events and keeps the results in ``values[event]``."""

    def __init__(self, fns: Dict[Event, Callable[[Any], Any]]) -> None:
        self.fns = fns
        self.values: Dict[Event, List[Any]] = {e: [] for e in fns}

    def overridden_events(self) -> list:
        return list(self.fns)

    def run_event(self, event: Event, state, logger) -> None:
        self.values[event].append(self.fns[event](state))


class RecordAlgorithm(Algorithm):
    """Like `Record`, but an algorithm, so it can sit at a chosen place in the algorithm order."""

    def __init__(self, fns: Dict[Event, Callable[[Any], Any]]) -> None:
        self.fns = fns
        self.values: Dict[Event, List[Any]] = {e: [] for e in fns}

    def match(self, event, state) -> bool:
        return event in self.fns

    def apply(self, event, state, logger) -> None:
        self.values[event].append(self.fns[event](state))


class MemoryDestination(LoggerDestination):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []
        self.hyperparameters: Dict[str, Any] = {}
        self.closed = False

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparameters(self, hyperparameters) -> None:
        self.hyperparameters.update(hyperparameters)

    def close(self) -> None:
        self.closed = True

    def series(self, key: str) -> List[tuple]:
        return [(step, m[key]) for step, m in self.calls if key in m]


class TinyLM(torch.nn.Module):
    """A token model for dict batches with ``input_ids`` and ``labels`` (next-token cross-entropy)."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, batch):
        return self.head(self.embed(batch["input_ids"]))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


def token_batches(
    num_batches: int = 8, batch_size: int = 4, seq_len: int = 64, vocab: int = 16, seed: int = 0
) -> List[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.roll(-1, dims=1)})
    return out
