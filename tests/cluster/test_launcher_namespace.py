"""The launcher's namespaces hide the machine's /tmp yet keep what the test needs from under it.

A repository cloned under /tmp (a ``mktemp -d`` checkout, with spaces in its path) must stay
visible inside, at its own path, or every launcher step fails with ``cd: ...: No such file or
directory`` (issue 31). Starting the namespaces takes seconds (no ``ray up``); skipped, with the
reason, where they cannot be made (not root, no ``unshare``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from local_launcher import REPO, LocalLauncher, cannot_run, paths_to_keep

pytestmark = [pytest.mark.launcher]


def test_paths_to_keep_hold_the_repository_and_only_the_outermost_paths():
    assert all(p.startswith("/tmp/") for p in paths_to_keep())
    root = os.path.realpath(os.path.dirname(REPO))  # stands for /tmp: the directory holding this checkout
    kept = paths_to_keep(root)
    assert any(os.path.realpath(REPO) == p or os.path.realpath(REPO).startswith(p + os.sep) for p in kept), kept
    assert all(p.startswith(root + os.sep) for p in kept), kept
    assert not any(a != b and a.startswith(b + os.sep) for a in kept for b in kept), kept


def test_a_directory_under_tmp_stays_visible_inside_and_the_rest_of_tmp_is_private():
    reason = cannot_run()
    if reason:
        pytest.skip(f"launcher namespaces: {reason}")
    clone = tempfile.mkdtemp(prefix="rte keep ", dir="/tmp")  # a space in the path, as a user's clone may have
    other = tempfile.mkdtemp(prefix="rte-hidden-", dir="/tmp")
    inner = os.path.join(clone, "main")
    os.makedirs(inner)
    with open(os.path.join(inner, "marker.txt"), "w") as fh:
        fh.write("visible\n")
    launcher = LocalLauncher(keep=paths_to_keep() + [inner])  # this checkout too, wherever it is
    try:
        launcher.prepare_namespace()
        launcher.start()
        proc = launcher.run(f"cat marker.txt && pwd && test ! -e {other} && echo written > inside.txt", cwd=inner)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.splitlines() == ["visible", inner]
        # Bound, not copied: what is written inside lands in the real directory.
        with open(os.path.join(inner, "inside.txt")) as fh:
            assert fh.read() == "written\n"
        # /tmp itself is the private one: what the namespace writes there stays in the launcher's base.
        assert launcher.run("touch /tmp/rte-private-probe", cwd=inner).returncode == 0
        assert os.path.exists(os.path.join(launcher.base, "tmp", "rte-private-probe"))
        assert not os.path.exists("/tmp/rte-private-probe")
    finally:
        leftovers = launcher.close()
        shutil.rmtree(clone, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)
    assert not leftovers, leftovers
