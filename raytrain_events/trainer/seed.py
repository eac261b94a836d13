"""`seed_everything`: the one place that seeds Python's, torch's and numpy's global RNGs."""

from __future__ import annotations

import random

import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed ``random``, ``torch`` (CPU and every CUDA device) and ``numpy`` with ``seed``.

    The `Trainer` calls it with ``seed + rank`` (different data augmentation per rank); the Ray
    worker calls it with ``seed`` before building the model (the same initial weights on every rank).
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return
    np.random.seed(seed % (2**32))
