"""Small torchmetrics metrics the shipped models use (synchronized across ranks by torchmetrics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric

__all__ = ["CrossEntropy"]


class CrossEntropy(Metric):
    """Mean cross-entropy over every sample seen (summed, then divided, so shards weigh right)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += F.cross_entropy(outputs.float(), targets, reduction="sum").double()
        self.count += targets.shape[0]

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()
