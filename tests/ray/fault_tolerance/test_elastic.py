"""Elastic worker groups: ``num_workers=(min, max)`` becomes Ray's elastic ``ScalingConfig``.

The end-to-end elastic run (a node lost, the group continuing on fewer workers, a node added and the
group growing back, exact Timestamp, every row once) is the chaos soak's: ``test_chaos_soak.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_num_workers_range_makes_an_elastic_scaling_config():
    from raytrain_events.ray.spec import RunSpec

    base = dict(model=print, optimizers=print, datasets={"train": None}, max_duration="1ep")
    config = RunSpec(**base, num_workers=(1, 3), resources_per_worker={"CPU": 0.5}).scaling.ray_scaling_config()
    assert config.elasticity_enabled and (config.min_workers, config.max_workers) == (1, 3)
    with pytest.raises(ValueError, match=r"\(min, max\)"):
        RunSpec(**base, num_workers=(3, 1))
