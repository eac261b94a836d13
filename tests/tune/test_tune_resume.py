"""An interrupted sweep resumes: the finished trial is not trained again, the rest finish.

A subprocess runs a 2-trial sweep (one trial at a time, its own local Ray); as soon as the first
trial has finished (its ``raytrain_trial.json`` exists) the subprocess and every process it
started (its whole Ray instance) are SIGKILLed. Then ``sweep(..., resume=True)`` with the same
storage and name runs in this process; per-trial marker files written by rank 0 at fit start and
fit end show which trainings ran.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from tune_helpers import RESUME_SETS, markers, resumable_sweep, trial_tag

from raytrain_events.tune import TRIAL_RECORD, algorithm_set_label

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


def _children() -> dict:
    kids: dict = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    return kids


def _descendants(pid: int) -> list:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the sweep's driver and everything it started (its Ray head, workers, trials)."""
    pids = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


@pytest.mark.timeout(1500)
def test_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_cluster, tmp_path):
    storage, marks = tmp_path / "sweeps", tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", TUNE_DISABLE_AUTO_CALLBACK_LOGGERS="1")
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "interrupted.log", "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tune_helpers.py"), str(storage), str(marks)],
        cwd=str(tmp_path),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    records = os.path.join(str(storage), "resumable", "trial_*", TRIAL_RECORD)
    try:
        deadline = time.time() + 900
        while not glob.glob(records):
            assert proc.poll() is None, f"the sweep subprocess exited early (rc={proc.returncode}); see {log.name}"
            assert time.time() < deadline, "no trial finished in time"
            time.sleep(0.5)
    finally:
        _kill_tree(proc)
        log.close()
    (first_record,) = glob.glob(records)
    first_trial_id = os.path.basename(os.path.dirname(first_record))[len("trial_") :]
    finished = markers(str(marks), "end")
    assert len(finished) == 1, finished  # killed after exactly one trial finished
    (first,) = finished
    assert first == trial_tag({"algorithms": RESUME_SETS[0], "lr": 0.2})  # one trial at a time, in grid order

    result = resumable_sweep(str(storage), str(marks), resume=True)

    print(result.to_table())
    ends = markers(str(marks), "end")
    assert ends == {trial_tag({"algorithms": s, "lr": 0.2}): 1 for s in RESUME_SETS}  # each set trained to the end once
    assert sorted(row["algorithms"] for row in result.rows) == sorted(algorithm_set_label(s) for s in RESUME_SETS)
    assert all(row["status"] == "completed" and row["time/sample"] == 512 for row in result.rows), result.rows
    assert result.best is not None and result.best_algorithms in RESUME_SETS
    assert len(glob.glob(records)) == 2
    assert first_trial_id in {row["trial_id"] for row in result.rows}  # the same sweep, resumed
