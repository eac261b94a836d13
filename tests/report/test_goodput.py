"""Goodput and restarts from a run's history: counted time, time lost per failure, causes, the report."""

from __future__ import annotations

import json

import pytest

from raytrain_events.report import append_history, write_report
from raytrain_events.report.goodput import goodput, read_events


def _history():
    """Two attempts at 1 s per batch: the first trains batches 0-12 (reports at 5, 10, 12) and dies;
    the second starts 20 s after the first's batch 12, resumes from 8 (its checkpoint) and ends at 20."""
    first = [
        {"attempt": 1, "attempt_started_at": 100.0, "resumed_from_batch": 0, "wall_time": 105.0, "time/batch": 5},
        {"attempt": 1, "wall_time": 110.0, "time/batch": 10},
        {"attempt": 1, "wall_time": 112.0, "time/batch": 12},
    ]
    second = [
        {"attempt": 2, "attempt_started_at": 132.0, "resumed_from_batch": 8, "wall_time": 137.0, "time/batch": 13},
        {"attempt": 2, "wall_time": 144.0, "time/batch": 20},
    ]
    return first + second


def test_counted_time_lost_time_and_goodput():
    summary = goodput(_history())
    # Counted: batches 0-8 of the first attempt (8 s) and 8-20 of the second (12 s), in 44 s of wall time.
    assert summary["counted_s"] == pytest.approx(20.0)
    assert summary["wall_s"] == pytest.approx(44.0)
    assert summary["goodput"] == pytest.approx(20.0 / 44.0)
    (restart,) = summary["restarts"]
    # The first attempt was at batch 8 at t=108; the second was back at batch 8 at 137 - 5 = 132.
    assert restart["lost_s"] == pytest.approx(24.0)
    assert restart["resumed_from_batch"] == 8 and restart["failed_at_batch"] == 12
    assert restart["cause"] == "a worker or node was lost"


def test_a_restart_is_attributed_to_the_hang_or_preemption_in_its_window():
    hang = {"wall": 125.0, "slowest_rank": 1, "batch": 12, "frame": "train.py:9 in load"}
    (restart,) = goodput(_history(), hangs=[hang])["restarts"]
    assert restart["cause"] == "hang: rank 1 at batch 12, in train.py:9 in load"
    sigterm = {"wall": 113.0, "stopping": True, "cause": "SIGTERM", "rank": 0}
    (restart,) = goodput(_history(), preemptions=[sigterm])["restarts"]
    assert restart["cause"] == "preemption: SIGTERM on rank 0"
    notice = {"wall": 113.0, "stopping": False, "cause": "preemption notice", "rank": 1, "saved_batch": 12}
    (restart,) = goodput(_history(), preemptions=[notice])["restarts"]
    assert restart["cause"] == "preemption: preemption notice on rank 1, saved at batch 12, then the node went"
    stopped = {"wall": 125.0, "slowest_rank": 2, "batch": None, "frame": None}  # SIGSTOP: no dump from it
    (restart,) = goodput(_history(), hangs=[stopped])["restarts"]
    assert restart["cause"] == "hang: rank 2, frozen or stopped (no stack dump)"
    grown = [dict(e, world_size=1 if e["attempt"] == 1 else 2) for e in _history()]  # a node came back
    (resized,) = goodput(grown)["restarts"]
    assert resized["cause"] == "resized: the group grew from 1 to 2 workers" and resized["failures"] == 0
    shrunk = [dict(e, world_size=2 if e["attempt"] == 1 else 1) for e in _history()]
    assert goodput(shrunk)["restarts"][0]["cause"] == "a worker or node was lost"
    elsewhere = dict(hang, wall=500.0)
    assert goodput(_history(), hangs=[elsewhere])["restarts"][0]["cause"] == "a worker or node was lost"


def test_an_uninterrupted_run_has_no_restarts_and_an_empty_one_no_goodput():
    summary = goodput(_history()[:3])
    assert summary["restarts"] == [] and summary["counted_s"] == pytest.approx(12.0)
    assert summary["goodput"] == pytest.approx(1.0)
    assert goodput([])["goodput"] is None


def test_the_run_report_shows_goodput_and_each_restart(tmp_path):
    run = str(tmp_path / "run")
    append_history(run, _history())
    (tmp_path / "run" / "hangs" / "g1").mkdir(parents=True)
    hang = {"wall": 125.0, "slowest_rank": 1, "batch": 12, "frame": "train.py:9 in load"}
    (tmp_path / "run" / "hangs" / "g1" / "hang.json").write_text(json.dumps(hang))
    assert read_events(run) == ([hang], [])
    written = write_report(run)
    page = (tmp_path / "run" / "report.html").read_text()
    assert "Goodput 45.5%" in page and "hang: rank 1 at batch 12" in page and "24 s lost" in page
    assert any(p.endswith("goodput.png") for p in written["images"])


def test_a_replica_group_quorum_change_is_marked_not_counted_as_a_restart(tmp_path):
    """A replica-groups run: one attempt at 1 s per batch; a group left before batch 6 and joined back before 9."""
    history = [
        {"attempt": 1, "attempt_started_at": 100.0, "wall_time": 105.0, "time/batch": 5},
        {"wall_time": 106.0, "time/batch": 6, "quorum_change": -1, "replica_groups": 2},
        {"wall_time": 109.0, "time/batch": 9, "quorum_change": 1, "replica_groups": 3},
        {"attempt": 1, "wall_time": 112.0, "time/batch": 12},
    ]
    summary = goodput(history)
    assert summary["restarts"] == [] and summary["goodput"] == pytest.approx(1.0)
    assert [(c["batch"], c["groups"]) for c in summary["quorum_changes"]] == [(6, 2), (9, 3)]
    run = str(tmp_path / "run")
    append_history(run, history)
    written = write_report(run)
    page = (tmp_path / "run" / "report.html").read_text()
    assert "3->2 groups at batch 6, 2->3 groups at batch 9" in page
    assert any(p.endswith("goodput.png") for p in written["images"])


def test_a_group_that_failed_before_its_first_report_is_its_own_failure_with_its_own_cause(tmp_path):
    """The first group hangs (t=125: the watchdog's record), its restart is killed before its first report (t=128),
    and the third group resumes (t=132): the history knows two attempts only; the controller's records name both
    failures, each with its own cause, in order. A failure after the last attempt started (the run's end) is no
    restart. Without the records: one restart, one cause, as before."""
    from ray.exceptions import RayActorError

    from raytrain_events.ray._compat import worker_death_errors
    from raytrain_events.ray.reports.failures import FailureRecorder, failure_record
    from raytrain_events.report.goodput import read_failures
    from raytrain_events.storage.run_dir import RunDir

    run = str(tmp_path / "run")
    append_history(run, _history())
    recorder = FailureRecorder(RunDir(run))
    hang = {"wall": 125.0, "slowest_rank": 1, "batch": 12, "frame": "train.py:9 in load"}
    (tmp_path / "run" / "hangs" / "g1").mkdir(parents=True)
    (tmp_path / "run" / "hangs" / "g1" / "hang.json").write_text(json.dumps(hang))
    for wall, errors in (
        (126.0, {1: TimeoutError("rank 1 hung at batch 12")}),
        (128.0, {0: RuntimeError("Connection closed by peer"), 1: worker_death_errors()[0]("gone", RayActorError())}),
        (150.0, {0: ValueError("the run's last failure")}),
    ):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("raytrain_events.ray.reports.failures.time.time", lambda wall=wall: wall)
            recorder.after_exception(None, errors)
    failures = read_failures(run)
    assert [(f["wall"], f["ranks"]) for f in failures] == [(126.0, [1]), (128.0, [0, 1]), (150.0, [0])]
    assert failures[1]["died"] == [1] and list(failures[1]["errors"]) == ["1", "0"]  # the dead rank first
    traceback = "Traceback (most recent call last):\n  ...\nValueError: boom"
    assert failure_record({0: RuntimeError(traceback)}, 0.0)["errors"] == {"0": "ValueError: boom"}
    (restart,) = goodput(_history(), [hang], [], failures)["restarts"]
    assert restart["failures"] == 2
    first, second = restart["cause"].split("; ")
    assert first == "hang: rank 1 at batch 12, in train.py:9 in load"
    assert second.startswith(
        "then its restart failed before its first report: a worker or node was lost (rank 1 died: "
    )
    assert second.endswith("and 1 more rank(s))")
    (without,) = goodput(_history(), [hang])["restarts"]
    assert without["cause"] == first and without["failures"] == 1
    write_report(run)
    page = (tmp_path / "run" / "report.html").read_text()
    assert "1 restart(s) after 3 failed worker group(s)" not in page
    assert "1 restart(s) after 2 failed worker group(s)" in page and "then its restart failed" in page
