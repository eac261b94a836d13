"""`prefetched`: run an iterator in a background thread, a few items ahead of the thread that uses them.

The train loader's per-batch work (fetching blocks, Arrow slices to NumPy to torch) then overlaps
the training step, where torch releases the GIL (backward, DDP's all-reduce), the way Ray Data's own
``iter_torch_batches`` formats batches in a thread. Order is kept, an error in the iterator is raised
in the consumer, and a consumer that stops early (a run that stops mid-epoch, or one that fails)
stops the thread: nothing keeps running after the epoch's iterator is closed or dropped.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

__all__ = ["prefetched"]

T = TypeVar("T")
_END = object()
_POLL_S = 0.1  # how often a producer blocked on a full buffer checks that its consumer is still there
_JOIN_S = 1.0  # how long a closing consumer waits for the producer to finish its current item


class _Raised:
    """An exception of the producer, on its way to the consumer."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(items: Iterator[T], depth: int, name: str) -> Iterator[T]:
    """Yield what ``items`` yields, produced up to ``depth`` items ahead by a daemon thread called ``name``.

    The thread starts at the first ``next()``; closing or dropping the returned iterator stops it.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    return _prefetch(items, depth, name)


def _prefetch(items: Iterator[T], depth: int, name: str) -> Iterator[T]:
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def put(item: object) -> bool:
        while not stopped.is_set():
            try:
                buffer.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # noqa: BLE001 - every error reaches the consumer, which re-raises it
            put(_Raised(error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator's own cleanup runs here, in the thread that ran it

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _END:
                return
            if type(item) is _Raised:
                raise item.error
            yield item
    finally:
        stopped.set()  # the producer stops before its next item (within _POLL_S if the buffer is full)
        thread.join(timeout=_JOIN_S)
