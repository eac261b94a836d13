"""Every ```python block of the README runs, in order, as one script (a fresh process).

The script is a fresh Python process, as a user's would be, but it joins the test session's Ray
(``RAY_ADDRESS`` set to the ``ray_cluster`` fixture's address, the way the README and the
examples run on a running cluster) instead of starting an embedded instance of its own: that
start-up was most of this test's time. Starting an embedded instance (`ensure_ray` with no Ray
running) is what the shared ``examples/train.py`` run checks (tests/examples/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_two_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = (
        'pip install -c constraints.txt -e ".[test,examples]" && ruff check . && ruff format --check . && mypy'
        " && python -m pytest -q"
    )
    assert test_command in text, "README's test command changed: keep it and .ci/run identical"
    assert test_command in ci, ".ci/run must run exactly the README's test command"
    assert "python examples/train.py" in text


@pytest.mark.slow
@pytest.mark.ray
def test_readme_python_blocks_run(ray_cluster, tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 6
    script = tmp_path / "readme_blocks.py"
    address = ray_cluster.get_runtime_context().gcs_address
    # After the README's code (and not part of it): the blocks ran on the session's Ray, not on an
    # embedded instance of their own.
    check = f"import ray\nassert ray.get_runtime_context().gcs_address == {address!r}, ray.get_runtime_context()\n"
    script.write_text("\n\n".join([*blocks, check]))
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_DATA_DISABLE_PROGRESS_BARS="1",
        RAY_ADDRESS=address,  # the session's Ray: the blocks' RayTrainer and sweep connect to it
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_readme_table_matches_what_ships():
    import raytrain_events.callbacks as callbacks
    import raytrain_events.loggers as loggers
    import raytrain_events.schedulers as schedulers
    from raytrain_events.algorithms import available_algorithms, build_algorithm

    text = README.read_text()
    for name in available_algorithms():
        assert f"`{type(build_algorithm(name)).__name__}` (`{name}`)" in text, name
    shipped = [n for n in callbacks.__all__ if n[0].isupper() and not n.endswith("Error")]
    shipped += [n for n in loggers.__all__ if n.endswith("Logger")]
    shipped += [n for n in schedulers.__all__ if n.endswith("Scheduler") and n != "Scheduler"]
    missing = [n for n in shipped if f"`{n}`" not in text]
    assert not missing, missing
