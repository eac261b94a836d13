"""`BatchCounters`: sum the loop's per-batch integers across ranks without a collective of their own.

Every batch the ranks sum a few integers: samples, tokens, a stop flag and the agreement flags
(see `raytrain_events.core.agreement`). Under DDP they ride on the gradient all-reduce DDP runs
anyway, reduced by DDP's own C++ reducer: DDP wraps `CountedModule`, the user's model plus one
small parameter that is always zero, and the loop adds ``parameter.dot(pieces)`` (zero) to
the loss before backward, which makes ``pieces`` that parameter's gradient. DDP averages it with
the other gradients (same bucket, no extra request) and `wait` multiplies by the world size.
No Python runs during backward: a communication hook or an ``autograd.Function`` would, and
each call takes the GIL from the worker's other threads (Ray Data's prefetching, Ray's own),
which measured 0.5-0.9 ms of CPU per batch on Ray workers. The counters travel as small pieces
(`piece_bits`), so that the averaged float sums round back to exact integers. With ``no_sync``
microbatches the counters ride on the last, synchronized backward; every other synchronized
backward of the batch carries zeros, because DDP expects a gradient for every parameter.

The ride is for DDP on the host (CPU training), where a collective of its own competes with the
model for the same cores. On a GPU the sums would come back in GPU memory, and reading them at
the end of each batch is a host sync: the host waits for backward and the gradient all-reduce
before it can queue the next batch. On an H200 (2 ranks, 2.3 ms steps) that measured 0.87x a
plain DDP loop, where the host-side collective measured 1.00x (`bench/gpu_overhead.py`), so
there the counters keep their own collective.

Where the counters do not ride (GPUs, FSDP, auto microbatching, DDP with
``find_unused_parameters`` as LayerFreezing asks, more values than the parameter holds, or a
batch whose backward reduced nothing) they are summed by `Dist.sum_ints_async` on host memory
(a gloo group), started before the batch so it overlaps with forward and backward and never
touches a GPU stream. In one process the loop uses none of this: the batch's values are the
sums (`Trainer._run_epoch`).
"""

from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Sequence

import numpy as np
import torch

from raytrain_events.dist import Dist, PendingSum

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "Counters",
    "BatchCounters",
    "CountedModule",
    "MAX_VALUES",
    "encode_counters",
    "decode_counters",
    "piece_bits",
]

_VALUE_BITS = 63  # counters are non-negative int64 values
_MANTISSA_BITS = {torch.float32: 24, torch.float64: 53}
MAX_VALUES = 16  # values a batch carries on the gradients: samples, tokens, stop and 13 agreement flags


def piece_bits(world_size: int, mantissa_bits: int = 24) -> int:
    """Bits per piece so that DDP's average of ``world_size`` pieces, times the world size, rounds back exactly.

    DDP multiplies each gradient by 1 / world_size and sums them, so the mean is off by at most
    ``world_size + 1`` rounding errors; with pieces below ``2 ** (mantissa - 2 - 2 * b)`` (``b`` the bit
    length of the world size) the sum it gives back is within 1/4 of the exact integer.
    """
    return min(16, mantissa_bits - 2 - 2 * world_size.bit_length())


def _pieces_per_value(bits: int) -> int:
    return -(-_VALUE_BITS // bits)


def encode_counters(values: Sequence[int], bits: int) -> "np.ndarray":
    """``values`` (non-negative ints) as little-endian pieces of ``bits`` bits each (int64, numpy: the
    loop cuts them every batch, where a Python loop or ``torch.tensor(list)`` cost tens of microseconds)."""
    array = np.array(values, dtype=np.int64)
    if array.size and array.min() < 0:
        raise ValueError(f"Batch counters must be >= 0, got {list(values)}.")
    shifts = np.arange(_pieces_per_value(bits), dtype=np.int64) * bits
    return ((array[:, None] >> shifts) & ((1 << bits) - 1)).ravel()


def decode_counters(pieces: Sequence[float], bits: int) -> List[int]:
    """Inverse of `encode_counters` for summed pieces (each sum within 1/2 of an integer)."""
    pieces_per_value = _pieces_per_value(bits)
    out: List[int] = []
    for start in range(0, len(pieces), pieces_per_value):
        value = 0
        for index, piece in enumerate(pieces[start : start + pieces_per_value]):
            value += int(round(piece)) << (bits * index)
        out.append(value)
    return out


class CountedModule(torch.nn.Module):
    """What DDP wraps when the counters ride on its all-reduce: the model, plus the parameter that carries them.

    The parameter stays out of the model's ``state_dict`` (checkpoints hold the model alone) and
    out of its optimizers; only its gradient is ever used. float32 (in the first gradient bucket
    of a float32 model) up to 255 ranks, float64 beyond, where float32 pieces would be too small.
    It lives in host memory: the ride is for DDP on the CPU (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, world_size: int) -> None:
        super().__init__()
        self.model = model
        dtype = torch.float32 if world_size < 256 else torch.float64
        size = MAX_VALUES * _pieces_per_value(piece_bits(world_size, _MANTISSA_BITS[dtype]))
        self.counters = torch.nn.Parameter(torch.zeros(size, dtype=dtype))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


class Counters(Protocol):
    """What the loop needs of its per-batch sums across ranks (`BatchCounters`, `DeferredCounters`).

    ``start(values)`` before the batch's forward, ``wait()`` after its backward for the sums;
    when ``on_gradients`` the values ride on the backward: ``carry(loss)`` is what to backpropagate,
    then ``after_backward()``.
    """

    on_gradients: bool

    def start(self, values: Sequence[int]) -> None: ...

    def carry(self, loss: Any) -> Any: ...

    def after_backward(self) -> None: ...

    def wait(self) -> List[int]: ...


class BatchCounters:
    """The loop's per-batch sum across ranks: `start` before the batch, `wait` after its optimizer step.

    Example::

        counters = BatchCounters(dist, ddp_model)   # ddp_model wraps a CountedModule: on the gradients
        counters.start([samples, tokens, stop, *flags])
        counters.carry(loss).backward()             # for every backward of the batch
        counters.after_backward()
        ...                                         # optimizer step
        global_samples, global_tokens, stops, *flags = counters.wait()
    """

    def __init__(self, dist: Dist, ddp: "Optional[DistributedDataParallel]" = None) -> None:
        self.dist = dist
        module = ddp.module if ddp is not None else None
        self.on_gradients = dist.is_distributed and isinstance(module, CountedModule)
        self._values: Optional[List[int]] = None
        self._pending: Optional[PendingSum] = None  # the separate collective, where the gradients cannot carry
        self._grad: Optional[torch.Tensor] = None  # this batch's pieces, until a synchronized backward takes them
        self._taking = False  # the running backward carries this batch's pieces
        self._carried = False  # a backward of this batch carried them
        self._sums: Any = None  # the averaged pieces (a tensor) once that backward is done
        # The last values encoded into the buffer, and the last averaged pieces (bytes) with their sums:
        # encoding and decoding are skipped while they repeat (tens of microseconds of Python per batch).
        self._encoded: Optional[List[int]] = None
        self._summed, self._decoded = b"", [0]
        if self.on_gradients:
            assert ddp is not None and isinstance(module, CountedModule)
            self._ddp, self._slot = ddp, module.counters
            slot = self._slot
            self._zeros = torch.zeros_like(slot, requires_grad=False)
            self._bits = piece_bits(dist.world_size, _MANTISSA_BITS[slot.dtype])
            self._pieces_per_value = _pieces_per_value(self._bits)
            self._world_size = dist.world_size
            self._host = torch.zeros_like(slot, requires_grad=False)  # the pieces, in one reused buffer
            self._host_np = self._host.numpy()

    # ------------------------------------------------------------------ loop
    def start(self, values: Sequence[int]) -> None:
        """Begin summing ``values`` for this batch (before its forward)."""
        if self.on_gradients and len(values) <= MAX_VALUES:
            values = list(values)
            if values != self._encoded:  # most batches send what the last one sent: the buffer holds it
                pieces = encode_counters(values, self._bits)
                host = self._host_np
                host[: pieces.size] = pieces
                host[pieces.size :] = 0
                self._encoded = values
            self._grad = self._host
            self._values, self._carried, self._sums = values, False, None
            return
        self._grad = None
        self._pending = self.dist.sum_ints_async(values)

    def carry(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` to call backward on: under a synchronized DDP backward it carries the counters (or zeros).

        ``loss + slot.dot(pieces)``: the parameter is zero, so the value is unchanged, and the
        gradient it gets is ``pieces``, all in torch's C++ autograd (a Python `autograd.Function`
        would take the GIL in the middle of backward). Call it on the loss as backward sees it
        (after loss scaling), so that the pieces arrive unscaled.
        """
        if not self.on_gradients or not self._ddp.require_backward_grad_sync:
            return loss
        grad = self._grad
        if grad is None:  # taken by an earlier backward of this batch (SAM's closure), or not carried
            grad = self._zeros
        else:
            self._grad, self._taking = None, True
        return loss + self._slot.dot(grad)

    def after_backward(self) -> None:
        """After each backward: take the averaged pieces out of the parameter's gradient and clear it."""
        if not self.on_gradients:
            return
        slot = self._slot
        grad, slot.grad = slot.grad, None
        if not self._taking:
            return
        self._taking, self._carried = False, True
        assert grad is not None, "DDP reduced no gradient for the counters"
        self._sums = grad

    def wait(self) -> List[int]:
        """The sums of this batch's values over all ranks (after its backward)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            return pending.wait()
        values, self._values, self._grad = self._values, None, None
        assert values is not None, "BatchCounters.wait() without start()"
        if not self._carried:
            # No synchronized backward this batch (on every rank alike, since DDP reduces
            # collectively): sum the values by themselves.
            return self.dist.sum_ints_async(values).wait()
        self._carried = False
        sums, self._sums = self._sums, None
        world_size, needed = self._world_size, len(values) * self._pieces_per_value
        pieces = sums.numpy()[:needed]  # a numpy view: slicing it costs less than slicing the tensor
        summed = pieces.tobytes()
        if summed != self._summed:  # the same averaged pieces as the last batch decode to the same sums
            self._decoded = decode_counters([piece * world_size for piece in pieces.tolist()], self._bits)
            self._summed = summed
        return list(self._decoded)
