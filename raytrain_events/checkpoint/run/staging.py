"""`HostStager`: the device-to-host copy of an async save, into host buffers reused by later saves.

An async save copies the state's tensors off the training tensors (so training can go on) and
uploads the copy in the background. Allocating that copy at every save costs an allocation per
tensor per save -- and, on GPU, pinning fresh host memory, which is slow and unpredictable -- on
the training thread. Like torchtitan's async checkpointing with pinned memory, the buffers are
allocated once per tensor (its place in the state tree, shape, dtype; pinned when the source is
on CUDA, so the copies are asynchronous DMA and one ``synchronize`` ends them) and reused by
every later save whose tensor has the same place, shape and dtype. A tensor that changed shape or
dtype (an optimizer state created after the first save) gets a new buffer at that save.

A buffer set is leased to one save until its upload ends (``Staged.release``). A save staged
while the previous one still holds the buffers (a synchronous save at the run's end, an explicit
``save()``) copies into fresh buffers instead of overwriting what is being uploaded.

DTensor shards (FSDP) are kept as DTensors: the first save builds a CPU DTensor with torch's own
staging helper (``_torch_compat.create_cpu_state_dict``), later saves copy the local shard into
it. Memory: one host copy of the state per rank lives for the run (the price of not allocating
per save; a synchronous run never makes one).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Tuple

import torch

__all__ = ["HostStager", "Staged"]

_Key = Tuple[Hashable, ...]
_LEAVES = frozenset((int, float, bool, str, bytes, type(None)))  # returned as they are (immutable, never tensors)


@dataclass
class Staged:
    """A staged copy of a state tree; ``release()`` once its upload is done (idempotent)."""

    tree: Any
    reused: int = 0  # tensors copied into buffers of an earlier save
    allocated: int = 0  # tensors that needed a new buffer
    _release: Callable[[], None] = field(default=lambda: None, repr=False)

    def release(self) -> None:
        release, self._release = self._release, lambda: None
        release()


def _on_accelerator(t: torch.Tensor) -> bool:
    """True for a CUDA source: its buffer is pinned and the copy is non-blocking."""
    return t.is_cuda


def _empty(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=pin)


def _synchronize() -> None:
    torch.cuda.synchronize()


@functools.cache
def _dtensor_type() -> type:  # imported once, not per tensor per save
    from torch.distributed.tensor import DTensor

    return DTensor


class HostStager:
    """Copies the tensors of a state tree to host buffers allocated once and reused (see module)."""

    def __init__(self) -> None:
        self._buffers: Dict[_Key, Any] = {}
        self._leased = False
        self._lock = threading.Lock()

    def stage(self, tree: Any) -> Staged:
        """A copy of ``tree`` whose tensors live in host buffers; training may change ``tree`` after."""
        with self._lock:
            reuse, self._leased = not self._leased, True
        buffers: Dict[_Key, Any] = self._buffers if reuse else {}
        counts: Dict[str, Any] = {"reused": 0, "allocated": 0, "device": False, "seen": set()}
        try:
            with torch.no_grad():
                out = self._walk(tree, (), buffers, counts)
                if counts["device"]:
                    _synchronize()  # the non-blocking copies have landed before anyone reads them
            for key in set(buffers) - counts["seen"]:  # tensors gone or reshaped: free their old buffers
                del buffers[key]
        except BaseException:
            if reuse:
                self._unlease()
            raise
        release = self._unlease if reuse else (lambda: None)
        return Staged(out, reused=counts["reused"], allocated=counts["allocated"], _release=release)

    def _unlease(self) -> None:
        with self._lock:
            self._leased = False

    def _walk(self, node: Any, where: Tuple[Hashable, ...], buffers: Dict[_Key, Any], counts: Dict[str, Any]) -> Any:
        if type(node) in _LEAVES:  # most nodes of a state tree (settings, counters): first, before the tensor test
            return node
        if isinstance(node, torch.Tensor):  # (a state_dict's tensors are detached already: no second detach)
            return self._copy(node.detach() if node.requires_grad else node, where, buffers, counts)
        if isinstance(node, dict):
            return {k: self._walk(v, where + (k,), buffers, counts) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            if all(type(v) in _LEAVES for v in node):  # a list of plain values (param ids, a window of losses)
                return type(node)(node)
            return type(node)(self._walk(v, where + (i,), buffers, counts) for i, v in enumerate(node))
        return node

    def _copy(
        self, src: torch.Tensor, where: Tuple[Hashable, ...], buffers: Dict[_Key, Any], counts: Dict[str, Any]
    ) -> Any:
        device = _on_accelerator(src)
        counts["device"] = counts["device"] or device
        if isinstance(src, _dtensor_type()):
            local = src.to_local()
            key: _Key = (where, "dtensor", tuple(src.shape), tuple(local.shape), src.dtype, src.placements)
            counts["seen"].add(key)
            buf = buffers.get(key)
            if buf is None:
                # why here: defers torch.distributed._state_dict_utils (DTensor and FSDP's machinery, ~2 s) to the first copy
                from raytrain_events._torch_compat import create_cpu_state_dict

                buf = create_cpu_state_dict({"t": src}, pin_memory=device)["t"]
                if buf is src or buf.to_local().data_ptr() == local.data_ptr():  # never alias the source
                    buf = create_cpu_state_dict({"t": src.detach().clone()}, pin_memory=device)["t"]
                buffers[key] = buf
                counts["allocated"] += 1
            else:
                counts["reused"] += 1
            buf.to_local().copy_(local, non_blocking=device)
            return buf
        key = (where, src.shape, src.dtype)  # torch.Size is a tuple: hashable as it is
        counts["seen"].add(key)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = _empty(src, device)
            counts["allocated"] += 1
        else:
            counts["reused"] += 1
        buf.copy_(src, non_blocking=device)
        return buf
