"""``examples/train.py`` continued by name, as a user does it: subprocesses, each its own embedded Ray.

Three runs with the same ``run_name``: the session's shared run of the example (``digits_run`` in
conftest.py: 2 epochs, keep=2, a checkpoint every 5 batches); ``resume=true`` to 3 epochs (keep=2)
with its driver SIGKILLed mid-epoch right after a checkpoint committed; ``resume=true`` again to
the end with keep=1 and ``verbose=true`` (whose console test_console_report.py's
`check_verbose_console` checks). Continuing by name after our pruning is the case that failed with
"The run snapshot contains a reference to a checkpoint that does not exist anymore" (the issue's
report: keep=2, a finished run, then resume=true); the kill can leave Ray's run snapshot behind the
newest committed checkpoint; the last run lowers keep, so its first save prunes what earlier runs kept.

Each finished run's summary must hold the exact global Timestamp of an uninterrupted run of the
same length (every worker's samples, 12 global batches of 128 rows per 1,500-row epoch). Which
rows were trained is checked row by row in tests/ray/test_resume.py, on the same code path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_console_report import check_verbose_console
from test_train_example import RUN_ARGS, RUN_NAME

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_ROWS, WORKERS, BATCHES_PER_EPOCH = 1500, 2, 12  # batch_size 64 per worker: 11 of 128 rows + 1 of 92


def _command(storage, run_name, epochs, *extra):
    return [
        sys.executable,
        os.path.join(REPO, "examples", "train.py"),
        f"max_duration={epochs}ep",
        f"num_workers={WORKERS}",
        f"storage={storage}",
        f"run_name={run_name}",
        "progress_bar=false",
        *extra,
    ]


def _env():
    env = dict(os.environ)
    env.update({"RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"})
    return env


def _run(cwd, command):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _check_finished(run_dir, epochs, keep):
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    ts = summary["timestamp"]
    assert (ts["epoch"], ts["batch"], ts["sample"]) == (epochs, epochs * BATCHES_PER_EPOCH, epochs * TRAIN_ROWS)
    on_disk = sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n != "index.json")
    assert len(on_disk) <= keep and [c["url"].rsplit("/", 1)[-1] for c in summary["checkpoints"]] == on_disk
    assert summary["checkpoints"][-1]["timestamp"]["sample"] == epochs * TRAIN_ROWS
    return summary


@pytest.mark.timeout(1800)  # two Ray runs after the shared one; minutes each on a loaded machine
def test_resume_by_name_then_driver_killed_then_resumed_again(digits_run, tmp_path):
    """Run 1 (the shared run) finished 2 epochs (keep=2); run 2 continues it by name to 3 epochs and
    its driver (with the embedded Ray it started) is SIGKILLed mid-epoch right after a new checkpoint
    committed; run 3 continues by name again with keep=1 (and verbose=true) and finishes with the
    exact Timestamp of an uninterrupted 3-epoch run, keep=1 holding on disk."""
    from raytrain_events.checkpoint import list_checkpoints

    storage, run_dir, name = digits_run["storage"], digits_run["run_dir"], RUN_NAME
    folder = os.path.join(run_dir, "checkpoints")
    first = _check_finished(digits_run["snapshot"], 2, keep=2)
    # keep=2: the newest two saves (every 5 batches and the end's at 24), the older ones pruned; a save due
    # while the one before it still uploads is postponed to the next batch (20 -> 21 on a loaded machine).
    kept = [c["timestamp"]["batch"] for c in first["checkpoints"]]
    assert len(kept) == 2 and 20 <= kept[0] < 24 and kept[1] == 24, kept
    with open(os.path.join(run_dir, "summary.json")) as fh:  # this test is the only one that continues it
        assert json.load(fh)["timestamp"]["epoch"] == 2, "the shared run was continued before this test"

    with open(tmp_path / "second.log", "w") as log:
        driver = subprocess.Popen(
            _command(storage, name, 3, *RUN_ARGS, "resume=true"),
            cwd=str(tmp_path),
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        done = 2 * BATCHES_PER_EPOCH
        deadline, newest = time.time() + 500, done
        while time.time() < deadline and driver.poll() is None and newest <= done:
            newest = max([c.batch for c in list_checkpoints(folder)] + [done])
            time.sleep(0.1)
        assert newest > done and driver.poll() is None, (
            "no new checkpoint before the run ended: " + open(log.name).read()[-3000:]
        )
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the embedded Ray it started
        driver.wait(timeout=60)
    with open(os.path.join(run_dir, "summary.json")) as fh:  # still run 1's: run 2 never finished
        assert json.load(fh)["timestamp"]["epoch"] == 2
    assert newest % BATCHES_PER_EPOCH != 0  # killed mid-epoch

    proc = _run(
        str(tmp_path),
        # report=false: the report is checked on the shared run (test_console_report.py); here it costs seconds.
        _command(storage, name, 3, "checkpoint.keep=1", "checkpoint.save_interval=5ba", "resume=true", "verbose=true")
        + ["report=false"],
    )
    assert "Resuming" in proc.stdout
    _check_finished(run_dir, 3, keep=1)
    check_verbose_console(proc.stdout + proc.stderr, name)
