"""Which replica group saves what after the saving lead is lost (`core/save_points.py`), without Ray."""

from __future__ import annotations

import pytest

from raytrain_events.core.save_points import LateSave, SavePoints


def test_a_lead_lost_while_writing_leaves_its_save_point_to_the_next_lead_once():
    points = SavePoints()
    for batch in (20, 30, 40):  # save points the lead (another group) saved while this group followed
        points.passed(batch)
    points.passed(40)  # the end's save at the same batch is one save point
    assert points.pending
    # The lead committed 20 and 30, and died with 40's upload in flight: this group, leading now, saves once, late.
    assert points.take_missed(newest_committed=30) == LateSave((40,))
    assert not points.pending and points.take_missed(newest_committed=30) is None  # asked once


def test_nothing_is_saved_again_when_the_lead_committed_its_save_points():
    points = SavePoints()
    points.passed(20)
    points.passed(30)
    assert points.take_missed(newest_committed=30) is None  # its manifest is there (the index reconciles it)
    points.passed(40)
    assert points.take_missed(newest_committed=50) is None  # a newer checkpoint (the lead's own) covers it


def test_every_save_point_after_the_newest_checkpoint_is_missed_by_one_late_save():
    points = SavePoints()
    points.passed(10)
    points.passed(20)  # the lead's saves failed or were in flight: none committed
    assert points.take_missed(newest_committed=None) == LateSave((10, 20))
    points.passed(30)
    points.passed(40)
    assert points.take_missed(newest_committed=30).missed == (40,)


def test_a_late_save_stands_in_for_something():
    with pytest.raises(ValueError, match="at least one missed save point"):
        LateSave(())
