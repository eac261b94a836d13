"""The end-to-end list (tests/e2e.py): its entries name real tests, and the audit tells the
processes that make a test end to end from the session's own (no Ray started here)."""

from __future__ import annotations

import ast
import os

import e2e


def _tests_in(path: str) -> set:
    with open(os.path.join(e2e.REPO, path)) as fh:
        tree = ast.parse(fh.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_entry_names_an_existing_module_and_its_tests():
    for module, names in e2e.E2E.items():
        assert os.path.exists(os.path.join(e2e.REPO, module)), f"tests/e2e.py lists {module}, which is gone"
        if names != e2e.ALL:
            missing = set(names) - _tests_in(module)
            assert not missing, f"tests/e2e.py lists {sorted(missing)} in {module}, which has no such test"


def test_the_audit_knows_each_kind_of_end_to_end_process():
    assert e2e.kind_of(["ray::TrainController.run"]) == "Ray Train run"
    assert e2e.kind_of(["ray::ImplicitFunc.train"]) == "Ray Tune trial"
    gcs = "/usr/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server"
    assert e2e.kind_of([gcs, "--log_dir=/tmp/ray/session_x/logs"]) == "Ray instance"
    assert e2e.kind_of(["/usr/bin/python", "/usr/local/bin/ray", "up", "-y", "cluster.yaml"]) == "ray up"
    assert e2e.kind_of(["ray", "job", "submit", "--", "python", "x.py"]) == "ray job"
    assert e2e.kind_of(["/usr/bin/python", "/repo/examples/train.py", "max_duration=1ep"]) == "example run"
    # The session's own Ray workers, idle workers, Ray Data and our light actors are not end to end.
    for cmdline in (
        ["ray::IDLE"],
        ["ray::RayTrainWorker"],  # only ever started by a controller, which is what counts
        ["ray::EpochFeeder.next"],
        ["ray::SplitCoordinator"],
        ["/usr/bin/python", "-m", "pytest", "tests/ray"],
        ["/usr/bin/python", "/repo/examples/train.py", "--help"],
        ["/usr/bin/python", "-c", "from multiprocessing.forkserver import main; main()"],
        [],
        [""],  # a process whose command line is gone or empty
    ):
        assert e2e.kind_of(cmdline) is None, cmdline


def test_the_audit_sees_a_process_the_running_test_starts(tmp_path, request):
    import contextlib
    import subprocess
    import sys

    script = tmp_path / "examples" / "sleepy.py"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(1.0)\n")
    audit = e2e.Audit(interval_s=0.05)
    audit.start()
    audit.current = "tests/x.py::test_x"
    session = getattr(request.config, "_e2e_audit", None)  # when the suite runs audited: not its concern
    with session.excluded() if session is not None else contextlib.nullcontext():
        subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    audit.check_alive()
    audit.stop()
    assert audit.started == {"tests/x.py::test_x": {"example run"}}
    assert dict(audit.counts["tests/x.py::test_x"]) == {"example run": 1}
