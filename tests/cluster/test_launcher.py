"""The cluster launcher flow end to end, as the README tells a user: `ray up cluster.yaml`, `ray submit`
of each submit-able example, `ray job submit`, `ray exec 'ray status'`, `ray down`.

The cluster is this machine, launched from the project's own cluster.yaml with AWS swapped for
Ray's local provider (see tests/cluster/local_launcher.py: SSH on 127.0.0.1:2222 inside loopback-only
network, mount and PID namespaces, a temporary HOME, the head's Python a venv over this one).
One `ray up` serves every step (the tests run in file order); the namespace is killed at the end,
which ends every process of this cluster and none other. Skipped, with the reason, where it
cannot run (not root, no namespaces).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time

import pytest
from local_launcher import LocalLauncher, cannot_run, install_packages

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from digits_checks import EPOCHS, TRAIN_ROWS, WORKERS, check_summary  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.launcher, pytest.mark.timeout(1800)]

STEP_TIMEOUT = 900
OVERLOADED = ("Deadline Exceeded", "timed out during startup")


def _out(proc) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


@pytest.fixture(scope="module")
def cluster():
    reason = cannot_run()
    if reason:
        pytest.skip(f"launcher test: {reason}")
    install_packages()
    launcher = LocalLauncher(num_cpus=4)
    started = time.time()
    try:
        launcher.prepare()
        launcher.start()
        token = launcher.run("ray get-auth-token --generate >/dev/null && test -s ~/.ray/auth_token", timeout=120)
        assert token.returncode == 0, _out(token)
        up = launcher.run(f"ray up -y --no-config-cache {launcher.config_path}", timeout=STEP_TIMEOUT)
        if up.returncode != 0 and any(m in up.stdout + up.stderr for m in OVERLOADED):
            # `ray start` gave up waiting for its own GCS (a machine loaded far past its cores): once more.
            up = launcher.run(f"ray up -y --no-config-cache {launcher.config_path}", timeout=STEP_TIMEOUT)
        assert up.returncode == 0, _out(up)
        # The head's session (a retried `ray up` leaves the first attempt's directory behind too).
        launcher.head_sessions = _sessions(launcher)
        launcher.down_done = False
        yield launcher
    finally:
        if not getattr(launcher, "down_done", True):
            launcher.run(f"ray down -y {launcher.config_path}", timeout=300)
        log = "\n".join(launcher.log)
        leftovers = launcher.close()
        print(f"launcher test: {time.time() - started:.0f}s in all\n{log[-20000:]}")
        assert not leftovers, f"processes of the test cluster still running after the namespace died: {leftovers}"


def _submit(cluster, script: str, *args: str):
    return cluster.run(f"ray submit {cluster.config_path} {script} {' '.join(args)}", timeout=STEP_TIMEOUT)


def _sessions(cluster) -> set:
    """The Ray session directories in the namespace's private /tmp/ray (one per Ray instance ever started)."""
    return set(glob.glob(os.path.join(cluster.base, "tmp", "ray", "session_2*")))


def _joined_the_cluster(cluster, output: str) -> None:
    """The script joined the head's Ray: no local instance was started, so no Ray session beyond the head's exists.

    Ray's own "Connecting to existing Ray cluster" INFO line is kept off the console by default (issue 13),
    so the session directories in the namespace's private /tmp/ray are the evidence.
    """
    assert "Started a local Ray instance" not in output, output
    assert _sessions(cluster) == cluster.head_sessions


def _summary(cluster, pattern: str) -> dict:
    found = glob.glob(os.path.join(cluster.home, pattern))
    assert len(found) == 1, found
    with open(found[0]) as fh:
        return json.load(fh)


def test_head_environment(cluster):
    """The installed, non-editable package is what a submitted script imports; the pins agree; token auth is on.

    One `ray exec` runs both probes (each `ray exec` is a `ray` CLI start and an SSH session: seconds here);
    `&&` makes a failing probe fail the command, and each probe's line is checked on its own.
    """
    probe = cluster.run(
        f"ray exec {cluster.config_path} "
        + '\'cd ~ && python -c "import raytrain_events, os; print(\\"PKG\\", raytrain_events.__file__, os.environ.get(\\"RAY_AUTH_MODE\\"))"'
        + " && python ~/src/raytrain_events/tests/cluster/pins.py'",
        timeout=300,
    )
    assert probe.returncode == 0, _out(probe)
    line = next(line for line in probe.stdout.splitlines() if line.startswith("PKG "))
    path, mode = line.split()[1:3]
    assert path.startswith(cluster.venv) and "site-packages" in path, line  # not ~/raytrain_events, not editable
    assert mode == "token"
    assert "pins agree" in probe.stdout


def test_ray_submit_train_with_defaults(cluster):
    """`ray submit cluster.yaml examples/train.py`: only the script is copied; the digits job's defaults."""
    proc = _submit(cluster, "examples/train.py")
    assert proc.returncode == 0, _out(proc)
    _joined_the_cluster(cluster, proc.stdout + proc.stderr)
    assert os.path.exists(os.path.join(cluster.home, "train.py"))  # what `ray submit` copied
    summary = _summary(cluster, "runs/digits-*/summary.json")
    assert summary["config"]["epochs"] == 8 and summary["config"]["num_workers"] == 2
    assert summary["timestamp"]["sample"] == TRAIN_ROWS * 8 and summary["timestamp"]["epoch"] == 8
    assert summary["metrics"]["metrics/eval/accuracy"] > 0.8


def test_ray_submit_train_tokens(cluster):
    proc = _submit(
        cluster,
        "examples/train_tokens.py",
        "--ray num_workers=2 max_duration=1ep 'files=[textwrap.py]' log_every=1ep storage=~/runs-tokens",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _out(proc)
    _joined_the_cluster(cluster, out)
    sequences = int(re.search(r"(\d+) sequences of", out).group(1))
    final = re.search(r"final timestamp: (\d+) tokens, (\d+) samples, (\d+) batches, (\d+) epochs", out)
    assert final, out[-3000:]
    samples = int(final.group(2))
    # One epoch: every sequence exactly once, split over the 2 workers (the global order drops no row).
    assert samples == sequences and int(final.group(4)) == 1


def test_ray_submit_tune_algorithms(cluster):
    # The two 1-worker trials at once (the cluster has 4 CPUs): with 2 epochs, max_t is ASHA's first
    # rung, so no trial is stopped and the order of the trials changes nothing checked here.
    proc = _submit(
        cluster,
        "examples/tune_algorithms.py",
        "--epochs 2 --sets 2 --workers 1 --max-concurrent 2 --storage ~/sweeps --name submit",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _out(proc)
    _joined_the_cluster(cluster, out)
    assert "best algorithm set:" in out
    assert os.path.isdir(os.path.join(cluster.home, "sweeps", "submit"))
    n_train = int(0.8 * 1797)  # the example's 80/20 split; ASHA lets the best trial run to max_t = 2 epochs
    assert f"best trial samples: {2 * n_train} (global" in out, out[-3000:]


def test_ray_job_submit(cluster):
    """The job API through the dashboard (on 127.0.0.1); a request without the token is refused.

    The job reads the config that ``ray up`` mounted on the head (``~/src/raytrain_events``) with
    overrides on the command line, and its run must pass the example tests' summary checks (so
    tests/examples does not submit the same job to a second cluster where this test runs).
    """
    probe = os.path.join(cluster.base, "no_token.py")
    with open(probe, "w") as fh:
        fh.write(
            "import urllib.error, urllib.request\n"
            "try:\n    urllib.request.urlopen('http://127.0.0.1:8265/api/jobs/', timeout=30); print('HTTP 200')\n"
            "except urllib.error.HTTPError as exc:\n    print('HTTP', exc.code)\n"
        )
    denied = cluster.run(f"python {probe}", timeout=120)
    assert "HTTP 401" in denied.stdout, _out(denied)
    proc = cluster.run(
        "RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- python examples/train.py "
        f"--config {cluster.home}/src/raytrain_events/examples/configs/digits.yaml max_duration={EPOCHS}ep "
        f"num_workers={WORKERS} storage={cluster.home}/runs-job run_name=job-check progress_bar=false"
        " report=false",  # the report is checked on the shared example run (tests/examples); here it costs seconds
        timeout=STEP_TIMEOUT,
    )
    assert proc.returncode == 0, _out(proc)
    assert "succeeded" in proc.stdout
    _joined_the_cluster(cluster, proc.stdout + proc.stderr)
    run_dir = os.path.join(cluster.home, "runs-job", "job-check")
    summary = check_summary(os.path.join(run_dir, "summary.json"), run_dir)
    assert summary["config"]["max_duration"] == f"{EPOCHS}ep"  # the override over the mounted config


def test_ray_exec_status_and_one_cluster(cluster):
    proc = cluster.run(f"ray exec {cluster.config_path} 'ray status'", timeout=300)
    assert proc.returncode == 0, _out(proc)
    assert "Resources" in proc.stdout and "CPU" in proc.stdout
    # Every script above joined the head's Ray: no Ray session was started after `ray up`.
    assert _sessions(cluster) == cluster.head_sessions


def test_ray_down_leaves_nothing_running(cluster):
    proc = cluster.run(f"ray down -y {cluster.config_path}", timeout=300)
    cluster.down_done = True
    assert proc.returncode == 0, _out(proc)
    deadline = time.time() + 30
    while (left := [p for p in cluster.processes() if "ray" in p or "python" in p]) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, left
