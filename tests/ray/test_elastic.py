"""Elastic worker groups: ``num_workers=(min, max)`` on a cluster that loses a node and regains one.

The run needs its own multi-node Ray cluster (``ray.cluster_utils.Cluster``), and the test
session already holds one ``ray.init``: it runs in a subprocess (``elastic_run.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


def test_num_workers_range_makes_an_elastic_scaling_config():
    from raytrain_events.ray.spec import RunSpec

    base = dict(model=print, optimizers=print, datasets={"train": None}, max_duration="1ep")
    config = RunSpec(**base, num_workers=(1, 3), resources_per_worker={"CPU": 0.5}).ray_scaling_config()
    assert config.elasticity_enabled and (config.min_workers, config.max_workers) == (1, 3)
    with pytest.raises(ValueError, match=r"\(min, max\)"):
        RunSpec(**base, num_workers=(3, 1))


@pytest.mark.timeout(1800)  # several Ray runs; minutes each on a loaded machine
def test_elastic_group_loses_a_node_continues_on_fewer_workers_and_grows_back(tmp_path):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "elastic_run.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ELASTIC_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert result["events"] == ["removed", "added"]
    assert result["timestamp"] == result["expected"]  # exact global Timestamp through two resizes
    worlds = result["worlds"]  # the group size that trained each global batch, in order
    first_one, last_one = worlds.index(1), len(worlds) - 1 - worlds[::-1].index(1)
    assert set(worlds[:first_one]) == {2} and set(worlds[first_one : last_one + 1]) == {1}
    assert set(worlds[last_one + 1 :]) == {2} and last_one + 1 < len(worlds), worlds
