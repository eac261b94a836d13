"""The autouse fixture in tests/conftest.py fails a test that leaks an environment variable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_leaking_test_fails_and_a_restoring_one_passes(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "e2e.py").write_text((ROOT / "tests" / "e2e.py").read_text())  # the conftest imports it
    (tests / "test_leaks.py").write_text(
        textwrap.dedent(
            """
            import os

            def test_leaks():
                os.environ["RAYTRAIN_EVENTS_LEAK_PROBE"] = "1"

            def test_restores(monkeypatch):
                monkeypatch.setenv("RAYTRAIN_EVENTS_LEAK_PROBE", "2")

            def test_allowed():
                os.environ.setdefault("RAY_LEAK_PROBE_ALLOWED", "1")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAYTRAIN_EVENTS_LEAK_PROBE"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The leak is reported at the leaking test's teardown (an error: the run fails) and undone.
    assert out.returncode != 0 and "3 passed, 1 error" in out.stdout, out.stdout + out.stderr
    assert "test_leaks leaked environment variables (RAYTRAIN_EVENTS_LEAK_PROBE: '<unset>' -> '1')" in out.stdout
