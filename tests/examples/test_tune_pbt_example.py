"""``examples/tune_pbt.py`` as a user runs it (a subprocess, an embedded local Ray), on a small population.

Three digits trials, two that cannot learn (lr 0) and one that does, for 3 epochs with a PBT
perturbation every epoch of global samples: a bad trial copies a good one (at least once),
switching to another algorithm set and a working LR, and the sweep's report shows the lineage.
The default population (four trials, six epochs) is the same code with more time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from test_train_example import REPO, _env

pytestmark = [pytest.mark.slow, pytest.mark.ray]

N_TRAIN = int(0.8 * 1797)  # the example's 80/20 split of the digits


def test_tune_pbt_example_copies_the_good_trial_into_the_bad_ones(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "tune_pbt.py"),
            *("--storage", str(tmp_path / "sweeps"), "--name", "pbt"),
            # Two trials that cannot learn and one that can, 3 epochs: two perturbation points each, so
            # a copy does not hinge on which trial reports its first epoch first.
            *("--sets", "1", "--lr", "0", "0.05", "0", "--epochs", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(tmp_path),
        env=_env(RAY_ADDRESS="local"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    copies = int(re.search(r"copies:\s+(\d+)", out).group(1))
    assert copies >= 1, out[-4000:]
    sweep_dir = tmp_path / "sweeps" / "pbt"
    paths = sorted(sweep_dir.glob("*/raytrain_trial.json"))
    records = [json.load(open(p)) for p in paths]
    for path, record in zip(paths, records):  # a copy loads another trial's checkpoint
        assert all(step["copied_trial"] != path.parent.name for step in record.get("lineage") or [])
    assert len(records) == 3
    steps = [step for record in records for step in record.get("lineage") or []]
    assert len(steps) == copies
    for step in steps:
        # Copies happen at epoch boundaries of global samples. (Whether the set changes is up to PBT:
        # the example resamples with probability 0.25 and may draw the donor's set again;
        # tests/tune/test_tune_pbt.py checks a changed set with resampling off.)
        assert step["counters"]["sample"] % N_TRAIN == 0 and step["counters"]["sample"] > 0
        assert step["counters"]["epoch"] == step["counters"]["sample"] // N_TRAIN
    # Every trial ends at the full duration, and the population learned: its best is far above chance.
    assert all(record["history"][-1]["time/sample"] == 3 * N_TRAIN for record in records)
    best = float(re.search(r"best metrics/eval/accuracy: ([0-9.]+)", out).group(1))
    assert best > 0.8, out[-4000:]
    html = (sweep_dir / "report.html").read_text()
    assert "Lineage (population-based training)" in html
