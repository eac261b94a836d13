"""The pure decisions of a loss spike (`raytrain_events.core.spikes`): the detector's verdicts, the
skip list's ranges and arithmetic, the rollback policy's limits, and every bad knob refused."""

from __future__ import annotations

import math

import pytest

from raytrain_events.core.spikes import RollbackPolicy, SkipList, SkipRange, SpikeDetector, SpikeRollbackError


def _warm(detector, n=20, loss=1.0, norm=1.0):
    for i in range(n):  # a little noise, so the gradient norms have a spread
        assert detector.observe(loss + 0.01 * (i % 3), norm + 0.01 * (i % 5)) is None


def test_no_verdict_during_warmup_then_a_loss_ratio_spike():
    detector = SpikeDetector(window=50, loss_ratio=2.0, grad_zscore=None, warmup=5)
    for _ in range(4):
        assert detector.observe(1.0) is None
    assert detector.observe(100.0) is None  # the 5th value: still warming up, and it joins the window
    detector = SpikeDetector(window=50, loss_ratio=2.0, grad_zscore=None, warmup=5)
    _warm(detector)
    assert detector.observe(1.9) is None
    verdict = detector.observe(2.5)
    assert verdict is not None and "2 x trailing mean" in verdict.reason and verdict.loss == 2.5


def test_non_finite_loss_or_gradient_norm_is_always_a_spike():
    detector = SpikeDetector(window=10, warmup=5)
    assert "not finite" in detector.observe(math.nan, 1.0).reason  # even before warmup
    assert "gradient norm inf" in detector.observe(1.0, math.inf).reason


def test_gradient_norm_zscore():
    detector = SpikeDetector(window=100, loss_ratio=None, grad_zscore=6.0, warmup=10)
    _warm(detector, 30)
    assert detector.observe(1.0, 1.05) is None  # within the spread
    verdict = detector.observe(1.0, 5.0)
    assert verdict is not None and "standard deviations" in verdict.reason


def test_a_spike_never_joins_the_window_and_the_window_is_trailing():
    detector = SpikeDetector(window=10, loss_ratio=2.0, grad_zscore=None, warmup=5)
    _warm(detector, 10)
    for _ in range(5):  # the same spike, judged again and again against the good batches only
        assert detector.observe(50.0) is not None
    state = detector.state_dict()
    assert max(state["losses"]) < 2 and len(state["losses"]) == 10
    for _ in range(10):  # the loss level moves up slowly: the trailing window follows it
        detector.observe(1.8)
    assert detector.observe(3.0) is None
    copy = SpikeDetector(window=10, loss_ratio=2.0, grad_zscore=None, warmup=5)
    copy.load_state_dict(detector.state_dict())
    assert copy.state_dict() == detector.state_dict()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(window=0), "window=0"),
        (dict(window=-3), "window=-3"),
        (dict(warmup=0), "warmup=0"),
        (dict(loss_ratio=0), "loss_ratio=0"),
        (dict(loss_ratio=-1.0), "loss_ratio=-1.0"),
        (dict(loss_ratio=1.0), "must be > 1"),
        (dict(grad_zscore=0.0), "grad_zscore=0.0"),
        (dict(grad_zscore=math.nan), "grad_zscore=nan"),
        (dict(window=5, warmup=10), "warmup=10 is longer than window=5"),
        (dict(window=True), "window=True"),
    ],
)
def test_bad_detector_knobs_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SpikeDetector(**kwargs)


def test_skip_list_ranges_totals_and_round_trip():
    skips = SkipList(fingerprint={"seed": 3})
    skips.add(SkipRange(1, 24, 48, batches=2, tokens=100))
    skips.add(SkipRange(0, 200, 216, batches=2, tokens=40))
    assert [r.epoch for r in skips.ranges] == [0, 1]  # kept in global order
    assert skips.totals() == (4, 40, 140)
    assert skips.totals(before_epoch=1) == (2, 16, 40)
    assert skips.contains(0, 200) and skips.contains(0, 215) and not skips.contains(0, 216)
    assert not skips.contains(1, 200)
    with pytest.raises(ValueError, match="overlaps epoch 0 rows \\[200, 216\\)"):
        skips.add(SkipRange(0, 210, 230))
    again = SkipList.from_state_dict(skips.state_dict())
    assert again == skips
    assert "epoch 0 rows [200, 216), epoch 1 rows [24, 48)" == skips.describe()


def test_skip_range_refuses_empty_or_negative():
    for bad in [(0, 5, 5), (0, 6, 5), (-1, 0, 5), (0, 0, 5, -1)]:
        with pytest.raises(ValueError, match="Not a skip range"):
            SkipRange(*bad)


def test_a_skip_list_from_other_data_is_refused():
    skips = SkipList(fingerprint={"seed": 3, "rows": 203})
    skips.check_fingerprint({"seed": 3})  # what both name agrees
    with pytest.raises(ValueError, match="other data .*seed: 3 there, 4 here"):
        skips.check_fingerprint({"seed": 4, "rows": 203})


def test_rollback_policy_stops_naming_the_positions():
    policy = RollbackPolicy(max_rollbacks=2, max_window=10)
    skips = SkipList([SkipRange(0, 8, 24, 2)])
    policy.check(1, 10, skips, "batch 5: loss 9")
    with pytest.raises(SpikeRollbackError, match=r"after 2 rollbacks .*epoch 0 rows \[8, 24\)"):
        policy.check(2, 3, skips, "batch 9: loss 9")
    with pytest.raises(SpikeRollbackError, match="would skip 11 batches .*max_window=10"):
        policy.check(0, 11, skips, "batch 9: loss 9")
    for bad in (dict(max_rollbacks=0), dict(max_window=0), dict(max_rollbacks=1.5)):
        with pytest.raises(ValueError):
            RollbackPolicy(**bad)


def test_group_votes_tell_a_spike_and_whether_every_group_holds_the_same_snapshot():
    """Replica groups sum their votes in the step's all-reduce: any group's flag is a spike for all; the limbs and
    their squares tell equal snapshot distances from unequal ones, the middle value of three included."""
    import torch

    from raytrain_events.core.spikes import MAX_SINCE_SNAPSHOT, group_vote, read_group_votes

    def verdict(votes):
        return read_group_votes([sum(column) for column in zip(*votes)], len(votes))

    same = verdict([group_vote(False, 7)] * 4)
    assert (same.spike, same.same_snapshot) == (False, True)
    assert verdict([group_vote(i == 2, 7) for i in range(4)]).spike  # one group's spike is every group's
    for distances in ([40, 45, 50], [0, 64], [4095, 4096], [7, 7, 7, 7 + 64**3], [MAX_SINCE_SNAPSHOT - 1, 0]):
        assert not verdict([group_vote(True, d) for d in distances]).same_snapshot, distances
    # Exact through a float32 all-reduce that averages (torchft's): 2,000 groups at the largest limbs.
    n, worst = 2000, group_vote(True, MAX_SINCE_SNAPSHOT - 1)
    mean = torch.tensor([worst] * n, dtype=torch.float32).sum(0) / n  # the sum, then the division, in float32
    assert [round(v * n) for v in mean.tolist()] == [w * n for w in worst]
    for bad in (-1, MAX_SINCE_SNAPSHOT, True):
        with pytest.raises(ValueError, match="since_snapshot"):
            group_vote(False, bad)
    with pytest.raises(ValueError, match="Not the sums of group votes"):
        read_group_votes([1, 2], 2)
