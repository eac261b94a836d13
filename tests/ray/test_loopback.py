"""The embedded Ray instance stays on 127.0.0.1 even when ``ray`` was imported first and
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is not set (issue 12, item 6).

The probe (tests/ray/loopback_probe.py) runs in a subprocess started with ``env -u`` for the
variable. Where possible (root, ``unshare``), the subprocess runs in its own network namespace
whose only interface is ``lo``, holding 127.0.0.1 and a fake routable address (192.0.2.77, the
default route's source): an unfixed Ray would pick that address, yet nothing it binds is reachable
from outside the namespace. Elsewhere the probe's guard refuses to start Ray at all if Ray would
pick a non-loopback address, so a regression fails the test without binding anything outside.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("loopback_probe.py")
FAKE_ROUTABLE = "192.0.2.77"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}  # the last: IPv4 loopback on a dual-stack socket
# A network namespace with only lo, holding 127.0.0.1 and FAKE_ROUTABLE as the default route's source.
NETNS = [
    "unshare",
    "-n",
    "sh",
    "-c",
    f"ip link set lo up && ip addr add {FAKE_ROUTABLE}/24 dev lo && "
    f'ip route add default dev lo src {FAKE_ROUTABLE} && exec "$@"',
    "netns",
]
UNSET = ["env", "-u", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]


def _run(command, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe and every Ray process it started
        out, err = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout}s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _isolation():
    """The netns prefix when this machine can make one, else an empty prefix."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return []
    code, _, _ = _run(NETNS + ["true"], timeout=30)
    return NETNS if code == 0 else []


def _unfixed_node_ip(prefix):
    """The address a plain ``ray.init()`` would give the node here, without the variable (nothing starts)."""
    code, out, err = _run(
        prefix + UNSET + [sys.executable, "-c", "import ray._private.services as s; print(s.get_node_ip_address())"],
        timeout=120,
    )
    assert code == 0, err
    return out.strip().splitlines()[-1]


def test_embedded_ray_binds_only_loopback_without_the_variable():
    prefix = _isolation()
    unfixed = _unfixed_node_ip(prefix)
    if unfixed in LOOPBACK:
        pytest.skip("Ray picks loopback here even unfixed (no routable address): nothing to test")

    code, out, err = _run(prefix + UNSET + [sys.executable, str(PROBE)], timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"the probe printed no result (exit code {code}):\n{err[-3000:]}"
    result = json.loads(lines[-1])
    assert "refused" not in result, (
        f"ensure_ray would have started Ray on {result['refused']} (unfixed Ray picks {unfixed}); the probe refused"
    )
    assert code == 0, err[-3000:]
    assert result["started_local"] is True
    assert result["env_after"] is None  # the variable is set for the start only
    not_loopback = {name: ip for name, ip in result["reported"].items() if ip not in LOOPBACK}
    assert not not_loopback, f"Ray reports non-loopback addresses: {not_loopback}"
    assert len(result["reported"]) >= 7  # driver, worker, GCS, node (3 ways), ray.nodes()
    assert len(result["sockets"]) >= 10, result["sockets"]
    listening = [s for s in result["sockets"] if s["status"] == "LISTEN"]
    assert {s["process"] for s in listening} >= {"gcs_server", "raylet"}, listening
    # A socket that can be reached from outside: listening, or bound without a peer, on a non-loopback
    # address (0.0.0.0 is every interface). Outgoing client sockets (the dashboard's DNS lookups,
    # connected to the resolver) get their source address from the route and accept nothing else.
    outside = [s for s in result["sockets"] if s["ip"] not in LOOPBACK and (s["status"] == "LISTEN" or not s["remote"])]
    assert not outside, f"sockets bound outside loopback: {outside}"
    connected_to_ray = [
        s for s in result["sockets"] if s["remote"] and s["ip"] not in LOOPBACK and s["remote"] == s["ip"]
    ]
    assert not connected_to_ray, f"Ray's processes talk over a non-loopback address: {connected_to_ray}"
