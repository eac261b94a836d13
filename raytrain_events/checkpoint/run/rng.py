"""Capture and restore every RNG a run uses (torch, CUDA, numpy, Python) as safe-to-load data.

The states are plain tensors, ints and lists, so they round-trip through
``torch.load(weights_only=True)``. A copy that stays in this process's memory (`HostSnapshots`)
takes `capture_rng_in_memory` instead: the generators' own state objects, with none of the
conversions a checkpoint needs (the 625 Python ints into a list, numpy's 624 keys into an int64
tensor): ~51 us a capture against ~60 us, measured alone; most of what is left is numpy's own
``get_state`` (~32 us: its MT19937 state read key by key).
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["RngInMemory", "capture_rng_in_memory", "capture_rng_state", "restore_rng_in_memory", "restore_rng_state"]

# torch's CPU state (a uint8 tensor), Python's ``random.getstate()``, numpy's legacy ``get_state()`` tuple,
# and every CUDA device's state (None when CUDA is not initialized).
RngInMemory = Tuple[torch.Tensor, Tuple[Any, ...], Any, Optional[List[torch.Tensor]]]


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


def capture_rng_in_memory() -> RngInMemory:
    """This process's RNG states as the generators return them, for a copy kept in memory only (not for
    ``torch.save``: numpy's state holds an ndarray); `restore_rng_in_memory` puts them back."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda


def restore_rng_in_memory(state: RngInMemory) -> None:
    """Put back what `capture_rng_in_memory` returned."""
    cpu, python, numpy_state, cuda = state
    torch.set_rng_state(cpu)
    random.setstate(python)
    np.random.set_state(numpy_state)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
