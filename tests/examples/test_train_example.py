"""The examples end to end, as a user runs them: subprocesses, real Ray, real files.

* ``examples/train.py`` with an embedded local Ray (what the no-argument run does): the session's
  shared run (``digits_run`` in conftest.py, also read by test_console_report.py and continued by
  test_resume_example.py);
* the same script submitted with ``ray job submit`` to a ``ray start --head`` cluster that this
  test starts in its own temp dir and tears down (without ``ray stop``, which would stop every
  Ray on the machine, the test session's own included), where the launcher test cannot run:
  where it can, its ``test_ray_job_submit`` submits the same job, with the same checks, to the
  cluster that ``ray up cluster.yaml`` started (one job-submit run per session, not two);
* ``examples/train_tokens.py`` locally (no Ray), whose duration is counted in tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from digits_checks import EPOCHS, TRAIN_ROWS, WORKERS, check_summary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster"))
from local_launcher import cannot_run  # noqa: E402

pytestmark = [pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The session's shared run of the example (conftest.py's `digits_run`): its name and checkpoint options.
RUN_NAME, RUN_ARGS = "digits-run", ("checkpoint.keep=2", "checkpoint.save_interval=5ba")


def _env(**extra):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", **extra})
    return env


def _args(storage, run_name):
    return [
        f"max_duration={EPOCHS}ep",
        f"num_workers={WORKERS}",
        f"storage={storage}",
        f"run_name={run_name}",
        "progress_bar=false",
    ]


@pytest.mark.ray
def test_train_example_with_embedded_ray(digits_run, tmp_path):
    """The shared run (2 epochs, 2 workers, checkpoint every 5 batches keeping 2): its summary, its
    console summary lines, and the CLI reading the run back."""
    stdout, run_dir, snapshot = digits_run["stdout"], digits_run["run_dir"], digits_run["snapshot"]
    summary = check_summary(os.path.join(snapshot, "summary.json"), run_dir, files_at=snapshot)
    assert f"epoch={EPOCHS} batch=" in stdout and f"sample={TRAIN_ROWS * EPOCHS}" in stdout
    assert "checkpoints: " + os.path.join(run_dir, "checkpoints") in stdout

    # The CLI reads the same run back: checkpoints with their Timestamps, and the saved config.
    from raytrain_events.cli.main import main

    out = tmp_path / "inspect.json"
    with open(out, "w") as fh:
        saved, sys.stdout = sys.stdout, fh
        try:
            assert main(["inspect", snapshot, "--json"]) == 0
        finally:
            sys.stdout = saved
    info = json.loads(out.read_text())
    assert [c["timestamp"] for c in info["checkpoints"]] == [
        {k: c["timestamp"].get(k, 0) for k in ("epoch", "batch", "sample", "token")} for c in summary["checkpoints"]
    ]
    assert info["config"]["max_duration"] == f"{EPOCHS}ep"


# ----------------------------------------------------------------------- ray job submit
def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_cli():
    path = shutil.which("ray")
    return [path] if path else [sys.executable, "-m", "ray.scripts.scripts"]


def _stat(pid):
    """``(state, ppid)`` of a live process, or None once it is gone (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]))


def _descendants(root):
    """``root`` and every process below it (Ray workers and the job's driver descend from the raylet)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _processes_using(temp_dir):
    """Live pids whose command line names ``temp_dir`` (gcs_server, raylet, agents of that cluster)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _stat(int(entry)) is None:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmdline:
            pids.append(int(entry))
    return pids


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(pids, grace=10.0):
    """SIGTERM ``pids``, SIGKILL whatever is left after ``grace`` seconds; returns the pids still alive."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and any(_stat(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        if _stat(pid):
            _signal(pid, signal.SIGKILL)
    time.sleep(0.5)
    return [pid for pid in pids if _stat(pid)]


@pytest.fixture
def head_node(tmp_path):
    """``ray start --head --block`` in its own temp dir and process group; stopped by pid, not ``ray stop``."""
    if not os.path.isdir("/proc"):
        pytest.skip("the teardown finds the cluster's processes through /proc (Linux)")
    # A short root: Ray's unix sockets live under it and their paths must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rte-", dir="/tmp")
    gcs, dashboard, client, agent, agent_grpc, env_agent, metrics = _free_ports(7)
    env = _env(RAY_AUTH_MODE="disabled")
    log = open(tmp_path / "ray-start.log", "w")
    head = subprocess.Popen(
        _ray_cli()
        + [
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={env_agent}",
            f"--metrics-export-port={metrics}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 180
        while True:
            if head.poll() is not None:
                pytest.fail(
                    f"ray start exited with {head.returncode}:\n{(tmp_path / 'ray-start.log').read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(
                    f"the dashboard at {url} did not come up:\n{(tmp_path / 'ray-start.log').read_text()[-3000:]}"
                )
            time.sleep(1)
        yield {"address": url, "env": env, "temp_dir": temp_dir}
    finally:
        # Stop only what this fixture started: the `ray start` process and everything below it
        # (gcs_server, raylet, dashboard, Ray workers, the job's driver), found before any of it
        # dies and gets re-parented, plus anything still naming this cluster's temp dir.
        tree = _descendants(head.pid)
        left = _stop(tree)
        head.wait(timeout=10)
        left += _stop(_processes_using(temp_dir), grace=5)
        log.close()
        leaked = left + _processes_using(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leaked, f"Ray processes of the test cluster still running: {leaked}"


@pytest.mark.ray
@pytest.mark.skipif(
    cannot_run() is None,
    reason="the same job is submitted, with the same checks, by tests/cluster/test_launcher.py::test_ray_job_submit",
)
def test_train_example_with_ray_job_submit(head_node, tmp_path):
    storage = str(tmp_path / "job-runs")
    runtime_env = {
        "working_dir": REPO,
        "excludes": [".git", "runs", ".hypothesis", ".pytest_cache", "*.egg-info", ".benchmarks"],
    }
    proc = subprocess.run(
        _ray_cli()
        + [
            "job",
            "submit",
            "--address",
            head_node["address"],
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--",
            "python",
            "examples/train.py",
            *_args(storage, "job-run"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=head_node["env"],
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    run_dir = os.path.join(storage, "job-run")
    check_summary(os.path.join(run_dir, "summary.json"), run_dir)
    # It joined the submitted-to cluster (the one with our temp dir) instead of starting its own Ray.
    sessions = [d for d in os.listdir(head_node["temp_dir"]) if d.startswith("session_2")]
    assert len(sessions) == 1
    # (Ray's own "Connecting to existing Ray cluster" INFO line is kept off the console by default.)
    assert "Started a local Ray instance" not in proc.stdout


# ------------------------------------------------------------------------- train_tokens
def test_train_tokens_example_locally(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "train_tokens.py"),
            "max_duration=3e4tok",
            "log_every=1e4tok",
            "warmup=2e3tok",
            "threads=1",
            "files=[random.py, textwrap.py]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("tok ")]
    assert len(lines) == 3
    tokens = [int(line.split()[1]) for line in lines]
    assert tokens[-1] >= 30000 and all(t >= 10000 * (i + 1) for i, t in enumerate(tokens))
    losses = [float(line.split("loss")[1].split()[0]) for line in lines]
    assert losses[-1] < losses[0]
    assert "loss fell from" in proc.stdout
