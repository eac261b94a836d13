"""What a user sees from ``python examples/train.py``: a clean console, and a run report at the end.

Two real runs of the example in subprocesses (an embedded local Ray each): with the default
settings the console has the progress bar and the summary but none of Ray's internal lines, and
the run directory gets report.html plus its PNGs; with ``verbose=true`` Ray's lines come back.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from png_checks import check_png
from test_train_example import REPO, _env

pytestmark = [pytest.mark.slow, pytest.mark.ray]

# Lines from Ray's internals that used to reach the terminal (issue 13), as regexes.
RAY_INTERNALS = [
    r"\(PlacementGroupCleaner",
    r"Failed to query Ray Train Controller actor state",
    r"PreemptionWatcher",
    r"max_restarts > 0",
    r"PYTHON worker processes have been started",
    r"Dataset \S+ execution finished",
    r"Progress bars disabled",
    r"\(TrainController",
    r"\(raylet\)",
    r"\(DatasetManager",
    r"\(SplitCoordinator",
    r"Started a local Ray instance",
    r"Setting up process group",
    r"Token authentication is enabled",
]


def _run_example(tmp_path, run_name, *extra):
    storage = str(tmp_path / "runs")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "train.py"),
            f"storage={storage}",
            f"run_name={run_name}",
            "num_workers=2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=str(tmp_path),
        env=_env(RAY_ADDRESS="local"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output, os.path.join(storage, run_name)


def test_default_console_is_clean_and_the_run_gets_a_report_then_verbose_shows_ray(tmp_path):
    output, run_dir = _run_example(tmp_path, "quiet", "max_duration=2ep")
    found = [p for p in RAY_INTERNALS if re.search(p, output)]
    assert not found, f"Ray-internal lines on the default console ({found}):\n{output[-6000:]}"
    # The one progress bar (global epoch/batch/samples, loss, eval metric) and the summary.
    assert re.search(r"quiet: +\d+%\|", output), output[-3000:]
    assert re.search(r"ep \d+ \| ba \d+ \| sp [\d,]+ \| loss [\d.]+ \| eval/accuracy [\d.]+", output), output[-3000:]
    assert "Run quiet finished in" in output and "eval accuracy" in output

    # The report, written at the end of the example.
    report = os.path.join(run_dir, "report.html")
    assert f"report:      {report}" in output
    html = open(report).read()
    for name, panels in (("metrics.png", 3), ("learning_rate.png", 1), ("throughput.png", 1)):
        assert f'src="{name}"' in html
        check_png(os.path.join(run_dir, name), panels)
    assert "Run config" in html and "Checkpoints" in html

    verbose, _ = _run_example(tmp_path, "loud", "max_duration=1ep", "verbose=true", "checkpoint.enabled=false")
    back = [p for p in RAY_INTERNALS if re.search(p, verbose)]
    assert len(back) >= 2, f"verbose=true should show Ray's own lines again; found {back}:\n{verbose[-4000:]}"
    assert "Run loud finished in" in verbose
