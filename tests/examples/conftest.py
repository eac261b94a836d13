"""One ``python examples/train.py`` run shared by the example tests that check the same path.

Each run of the example starts its own embedded Ray (a minute or more on a loaded 2-core
machine), and three test files used to run the same 2-worker digits job only to read different
things from it: the summary and the CLI (test_train_example.py), the console and the report
(test_console_report.py), and the run that is then continued by name (test_resume_example.py).
`digits_run` is that one run, with the default console (progress bar on) and a checkpoint every
5 batches, keeping 2. The resume test continues the run in place, so a copy of the run
directory as it finished (`snapshot`) is what the read-only checks look at, whatever the order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from test_train_example import EPOCHS, REPO, RUN_ARGS, RUN_NAME, WORKERS, _env


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """``examples/train.py`` for 2 epochs on 2 workers, embedded Ray, default console; run once per session.

    Yields a dict: ``stdout``, ``output`` (stdout + stderr), ``storage``, ``run_dir`` (the run
    directory, which the resume test goes on to continue), ``snapshot`` (a copy of it taken as soon
    as the run finished), ``cwd``.
    """
    cwd = tmp_path_factory.mktemp("digits-run")
    storage = str(cwd / "runs")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "train.py"),
            f"max_duration={EPOCHS}ep",
            f"num_workers={WORKERS}",
            f"storage={storage}",
            f"run_name={RUN_NAME}",
            *RUN_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=str(cwd),
        # RAY_ADDRESS=local: a fresh embedded Ray even if a `ray start` cluster runs on this machine.
        env=_env(RAY_ADDRESS="local"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    run_dir = os.path.join(storage, RUN_NAME)
    snapshot = str(cwd / "snapshot")
    shutil.copytree(run_dir, snapshot)
    yield {"stdout": proc.stdout, "output": output, "storage": storage, "run_dir": run_dir, "snapshot": snapshot}
