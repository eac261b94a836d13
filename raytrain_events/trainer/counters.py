"""`BatchCounters`: sum the loop's per-batch integers across ranks without a collective of their own.

Every batch the ranks sum a few integers: samples, tokens, a stop flag and the agreement flags
(see `raytrain_events.core.agreement`). Under DDP they ride on the gradient all-reduce DDP runs
anyway: a DDP communication hook appends them to the first gradient bucket (DDP keeps it small,
``first_bucket_bytes_cap``) and all-reduces gradients and counters together. The hook divides
only the gradients by the world size, as DDP's default hook does, and sends the counters
unscaled, split into 16-bit pieces so that their float sums stay exact integers (float32 holds
integers up to 2**24 exactly: 16 bits times up to 256 ranks). With ``no_sync`` microbatches the
counters ride on the last, synchronized backward.

Where that is not possible (one process, no DDP, gradients that are not float32/float64, or a
batch whose backward reduced no gradients) the counters are summed as before by
`Dist.sum_ints_async`, started before the batch so it overlaps with forward and backward.
"""

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, cast

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket, visible to mypy

from raytrain_events.dist import Dist, PendingSum

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["BatchCounters", "encode_counters", "decode_counters", "piece_bits"]

_EXACT_FLOAT32_BITS = 24  # float32 represents every integer below 2**24 exactly
_VALUE_BITS = 63  # counters are non-negative int64 values


def piece_bits(world_size: int) -> int:
    """Bits per piece so that a sum of ``world_size`` pieces stays below 2**24 (16 up to 256 ranks)."""
    return max(1, min(16, _EXACT_FLOAT32_BITS - max(1, (world_size - 1).bit_length()) - 1))


def encode_counters(values: Sequence[int], bits: int) -> List[int]:
    """``values`` (non-negative ints) as little-endian pieces of ``bits`` bits each."""
    pieces_per_value = -(-_VALUE_BITS // bits)
    mask = (1 << bits) - 1
    out: List[int] = []
    for value in values:
        if value < 0:
            raise ValueError(f"Batch counters must be >= 0, got {value}.")
        for index in range(pieces_per_value):
            out.append((value >> (bits * index)) & mask)
    return out


def decode_counters(pieces: Sequence[float], bits: int) -> List[int]:
    """Inverse of `encode_counters` for summed pieces (each sum an exact integer)."""
    pieces_per_value = -(-_VALUE_BITS // bits)
    out: List[int] = []
    for start in range(0, len(pieces), pieces_per_value):
        value = 0
        for index, piece in enumerate(pieces[start : start + pieces_per_value]):
            value += int(round(piece)) << (bits * index)
        out.append(value)
    return out


class BatchCounters:
    """The loop's per-batch sum across ranks: `start` before the batch, `wait` after its optimizer step.

    Example::

        counters = BatchCounters(dist, ddp_model)      # registers the DDP hook when it can be used
        counters.start([samples, tokens, stop, *flags])
        ...                                            # forward, backward (the hook sends them), step
        global_samples, global_tokens, stops, *flags = counters.wait()
    """

    def __init__(self, dist: Dist, ddp: "Optional[DistributedDataParallel]" = None) -> None:
        self.dist = dist
        self.on_gradients = ddp is not None and dist.is_distributed and _float_gradients(ddp)
        self._single = not dist.is_distributed  # one process: the sums are the values
        self._bits = piece_bits(dist.world_size)
        self._values: Optional[List[int]] = None  # waiting for the next synchronized backward
        self._sent: Optional[List[int]] = None  # the values the hook sent with a bucket
        self._sums: Any = None  # the summed pieces (a tensor) once the bucket's all-reduce is done
        self._event: Any = None  # CUDA: the copy of the sums to host memory
        self._pending: Optional[PendingSum] = None
        if self.on_gradients:
            assert ddp is not None
            self._group = ddp.process_group
            self._world_size = dist.world_size
            ddp.register_comm_hook(None, self._hook)

    # ------------------------------------------------------------------ loop
    def start(self, values: Sequence[int]) -> None:
        """Begin summing ``values`` for this batch (before its forward)."""
        if self._single:
            self._values = list(values)
        elif self.on_gradients:
            self._values, self._sent, self._sums, self._event = list(values), None, None, None
        else:
            self._pending = self.dist.sum_ints_async(values)

    def wait(self) -> List[int]:
        """The sums of this batch's values over all ranks (after its backward)."""
        if self._single:
            values, self._values = self._values, None
            assert values is not None, "BatchCounters.wait() without start()"
            return values
        if not self.on_gradients:
            pending, self._pending = self._pending, None
            assert pending is not None, "BatchCounters.wait() without start()"
            return pending.wait()
        if self._sent is None:
            # No gradient bucket was reduced this batch (nothing required grad, on every rank alike,
            # since DDP reduces collectively): sum the values by themselves.
            values, self._values = self._values, None
            assert values is not None, "BatchCounters.wait() without start()"
            return self.dist.sum_ints_async(values).wait()
        if self._event is not None:
            self._event.synchronize()
        sums, self._sums, self._sent = self._sums, None, None
        return decode_counters(sums.tolist(), self._bits)

    # ------------------------------------------------------------------ hook
    # DDP checks the annotations of a hook: they must be these real types (so no postponed annotations here).
    def _hook(self, _state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's all-reduce-mean of ``bucket``, with this batch's counters appended to the first bucket."""
        buffer: torch.Tensor = bucket.buffer()
        values = self._values
        if values is None or bucket.index() != 0:
            buffer.div_(self._world_size)
            work = tdist.all_reduce(buffer, group=self._group, async_op=True)
            assert work is not None
            return cast(torch.futures.Future[torch.Tensor], work.get_future().then(lambda f: f.value()[0]))
        self._values, self._sent = None, values
        pieces = encode_counters(values, self._bits)
        size = buffer.numel()
        combined = torch.empty(size + len(pieces), dtype=buffer.dtype, device=buffer.device)
        torch.div(buffer, self._world_size, out=combined[:size])
        combined[size:].copy_(torch.tensor(pieces, dtype=buffer.dtype))
        work = tdist.all_reduce(combined, group=self._group, async_op=True)
        assert work is not None

        def _split(fut: torch.futures.Future[List[torch.Tensor]]) -> torch.Tensor:
            summed = fut.value()[0]
            tail = summed[size:]
            if tail.is_cuda:  # copy to host without blocking; `wait` syncs on it after the step
                host = torch.empty(tail.shape, dtype=tail.dtype, pin_memory=True)
                host.copy_(tail, non_blocking=True)
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._event.record()
                self._sums = host
            else:
                self._sums = tail
            buffer.copy_(summed[:size])
            return buffer

        return cast(torch.futures.Future[torch.Tensor], work.get_future().then(_split))


def _float_gradients(ddp: "DistributedDataParallel") -> bool:
    """True if every gradient DDP reduces is float32/float64 (pieces < 2**24 add up exactly)."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return bool(params) and all(p.dtype in (torch.float32, torch.float64) for p in params)
