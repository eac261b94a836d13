"""`prefetched`: the train loader's background thread keeps order, passes errors on, and stops with its consumer."""

import gc
import threading
import time

import pytest

from raytrain_events.data.ray.prefetch import prefetched

NAME = "test-prefetch"


def _threads() -> list:
    return [t for t in threading.enumerate() if t.name == NAME]


def _wait_gone(seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads(), "the producer thread outlived its consumer"


def test_items_arrive_in_order_and_the_thread_ends_with_them() -> None:
    assert list(prefetched(iter(range(100)), 3, NAME)) == list(range(100))
    _wait_gone()


def test_the_producer_runs_ahead_of_the_consumer_by_at_most_depth_plus_one() -> None:
    made: list = []

    def source():
        for i in range(50):
            made.append(i)
            yield i

    items = prefetched(source(), 2, NAME)
    assert next(items) == 0
    # One taken, two in the buffer, one made and waiting for room. Waited for (a fixed 0.3 s sleep raced the
    # producer thread on a loaded machine), then given time to run further ahead, which it must not.
    deadline = time.monotonic() + 30
    while len(made) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(made) == 4
    items.close()
    _wait_gone()


def test_an_error_in_the_source_is_raised_in_the_consumer_after_the_items_before_it() -> None:
    def source():
        yield 1
        yield 2
        raise KeyError("no column 'x'")

    items = prefetched(source(), 1, NAME)
    assert next(items) == 1 and next(items) == 2
    with pytest.raises(KeyError, match="no column 'x'"):
        next(items)
    _wait_gone()


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_consumer_that_stops_early_stops_the_producer_and_closes_the_source(how: str) -> None:
    closed = threading.Event()

    def source():
        try:
            yield from range(10**9)
        finally:
            closed.set()

    items = prefetched(source(), 2, NAME)
    assert [next(items) for _ in range(5)] == [0, 1, 2, 3, 4]
    if how == "close":
        items.close()
    else:
        del items
        gc.collect()
    assert closed.wait(3.0), "the source generator was not closed"
    _wait_gone()


def test_no_thread_starts_before_the_first_item_is_asked_for() -> None:
    items = prefetched(iter([1]), 1, NAME)
    time.sleep(0.05)
    assert not _threads()
    del items


def test_a_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        prefetched(iter([]), 0, NAME)
