"""Count the bytes of CPU tensor storage alive at once (the peak) while a block runs.

A ``TorchDispatchMode`` sees every op's outputs; each new storage is added to the live total when
it appears and removed when it is freed (a finalizer on the storage, which outlives its views).
Meta tensors hold no memory and are not counted. What ops allocate inside a tensor subclass's
own dispatch (DTensor) is counted through the subclass's local tensor.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakStorageBytes(TorchDispatchMode):
    """``with PeakStorageBytes() as m: ...``; then ``m.peak`` (bytes) and ``m.live``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, Any] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", None)
        if local is not None:
            tensor = local
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self._seen[key] = weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self._seen.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out
