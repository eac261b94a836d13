"""What a user sees from ``python examples/train.py``: a clean console, and a run report at the end.

With the default settings the console has the progress bar and the summary but none of Ray's
internal lines, and the run directory gets report.html plus its PNGs: checked on the session's
shared run of the example (``digits_run`` in conftest.py, an embedded local Ray). With
``verbose=true`` Ray's lines come back: checked on the last run of
test_resume_example.py (the same example with its own embedded Ray), using `RAY_INTERNALS`.
"""

from __future__ import annotations

import os
import re

import pytest
from png_checks import check_png

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


def test_default_console_is_clean_and_the_run_gets_a_report(digits_run):
    output, run_dir, snapshot = digits_run["output"], digits_run["run_dir"], digits_run["snapshot"]
    name = os.path.basename(run_dir)
    found = [p for p in RAY_INTERNALS if re.search(p, output)]
    assert not found, f"Ray-internal lines on the default console ({found}):\n{output[-6000:]}"
    # The one progress bar (global epoch/batch/samples, loss, eval metric) and the summary.
    assert re.search(rf"{re.escape(name)}: +\d+%\|", output), output[-3000:]
    assert re.search(r"ep \d+ \| ba \d+ \| sp [\d,]+ \| loss [\d.]+ \| eval/accuracy [\d.]+", output), output[-3000:]
    assert f"Run {name} finished in" in output and "eval accuracy" in output

    # The report, written at the end of the example (read from the copy taken when the run finished).
    assert f"report:      {os.path.join(run_dir, 'report.html')}" in output
    html = open(os.path.join(snapshot, "report.html")).read()
    for png, panels in (("metrics.png", 3), ("learning_rate.png", 1), ("throughput.png", 1)):
        assert f'src="{png}"' in html
        check_png(os.path.join(snapshot, png), panels)
    assert "Run config" in html and "Checkpoints" in html


def check_verbose_console(output: str, run_name: str) -> None:
    """``verbose=true`` shows Ray's own lines again (at least two of `RAY_INTERNALS`), with the summary."""
    back = [p for p in RAY_INTERNALS if re.search(p, output)]
    assert len(back) >= 2, f"verbose=true should show Ray's own lines again; found {back}:\n{output[-4000:]}"
    assert f"Run {run_name} finished in" in output
