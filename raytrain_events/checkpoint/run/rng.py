"""Capture and restore every RNG a run uses (torch, CUDA, numpy, Python) as safe-to-load data.

The states are plain tensors, ints and lists, so they round-trip through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> Dict[str, Any]:
    """This process's RNG states."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
