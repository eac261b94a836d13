"""The run report lists checkpoint saves that failed for good (from the checkpoint index)."""

from __future__ import annotations

from raytrain_events.checkpoint.folder.index import CheckpointIndex
from raytrain_events.report import write_report


def test_failed_saves_section_from_the_index(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    index = CheckpointIndex(str(run / "checkpoints"))
    index.add_failure(str(run / "checkpoints/ckpt-000000000012-abcd"), 12, "OSError: store down", 1.7e9)
    assert index.unsaved
    index.save()
    assert not index.unsaved
    assert CheckpointIndex.load(str(run / "checkpoints")).failed == index.failed  # kept across loads
    html = (run / "report.html").read_text() if write_report(str(run)) else ""
    assert "Failed checkpoint saves" in html and "ckpt-000000000012-abcd" in html and "store down" in html


def test_no_section_without_failures(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    CheckpointIndex(str(run / "checkpoints")).save()
    write_report(str(run))
    assert "Failed checkpoint saves" not in (run / "report.html").read_text()
