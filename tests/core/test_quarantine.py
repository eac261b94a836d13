"""`find_culprits` and `Quarantine` (core/quarantine.py): the bisection's decisions without torch, at the issue's
size: 8 poisoned rows among 100,000 found with at most 1 clean row and the search's forwards counted."""

from __future__ import annotations

import math
import random

import pytest

from raytrain_events.core.quarantine import Quarantine, excess_test, find_culprits


def _oracle(losses, mean=1.0, ratio=2.0, batch_rows=64):
    return lambda a, b: excess_test(math.fsum(losses[a:b]), b - a, mean, ratio, batch_rows)


def test_eight_poisoned_rows_among_100000_are_found_alone():
    rng = random.Random(0)
    losses = [rng.gammavariate(2.0, 0.5) for _ in range(100_000)]  # clean rows: mean 1, a long right tail
    poisoned = sorted(rng.sample(range(100_000), 8))
    for i in poisoned:
        losses[i] = 300.0
    culprits, tested = find_culprits(len(losses), _oracle(losses))
    assert culprits == poisoned
    # 482,790 rows forwarded (4.8x the rows): with a forward a third of a training step (forward + backward),
    # 1.6x the compute of training them once; the bound is 4x.
    assert tested <= 5 * 100_000


def test_a_spike_no_row_explains_alone_finds_nothing_and_nan_is_guilty():
    # Two rows each under the bar (excess 40 < 64) that spike only together: no culprit, the window is skipped.
    losses = [1.0] * 64
    losses[3] = losses[40] = 41.0
    assert excess_test(sum(losses), 64, 1.0, 2.0, 64)
    assert find_culprits(64, _oracle(losses))[0] == []
    losses[40] = float("nan")
    assert find_culprits(64, _oracle(losses))[0] == [40]


def test_the_quarantine_file_round_trips_and_other_data_is_refused():
    q = Quarantine(fingerprint={"row_key": "id", "dataset_len": 400})
    q.add(317, 0, 312)
    q.add(203, 0, 200)
    q.add(203, 1, 0)  # the first quarantine of a row is kept
    again = Quarantine.loads(q.dumps())
    assert again.ids() == [203, 317] and again.rows[203] == (0, 200) and again.fingerprint == q.fingerprint
    run = Quarantine(fingerprint={"row_key": "id", "dataset_len": 400})
    run.merge(again)
    assert run.ids() == [203, 317]
    with pytest.raises(ValueError, match=r"other data \(dataset_len: 400 there, 392 here\)"):
        Quarantine(fingerprint={"row_key": "id", "dataset_len": 392}).merge(again)
    with pytest.raises(ValueError, match="not a quarantine file"):
        Quarantine.loads('{"rows": []}')
