"""``fault_tolerance="replica_groups"``: what it refuses, on the driver, before Ray starts (no Ray here)."""

from __future__ import annotations

import importlib.util

import pytest

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.ray.driver import RayTrainer
from raytrain_events.ray.replica_checks import lighthouse_bind
from raytrain_events.ray.spec import RunSpec


def _options(**over):
    base = dict(
        model=lambda: None,
        optimizers=lambda m: None,
        datasets={"train": object()},
        max_duration="1ep",
        num_workers=3,
        fault_tolerance="replica_groups",
    )
    base.update(over)
    return base


def test_replica_groups_are_a_run_option():
    spec = RunSpec(**_options())
    assert spec.fault_tolerance == "replica_groups"
    assert spec.for_workers().fault_tolerance == "replica_groups"  # the workers build their groups from it
    assert spec.describe()["fault_tolerance"] == "replica_groups"


@pytest.mark.parametrize(
    "over, named",
    [
        (dict(fault_tolerance="groups"), "fault_tolerance='groups'"),
        (dict(num_workers=1), "num_workers >= 2"),
        (dict(num_workers=(2, 4)), "elastic"),
        (dict(parallelism="fsdp"), "parallelism other than 'ddp'"),
        (dict(checkpoint=CheckpointConfig(save_interval="1ep")), "checkpoint="),
        (dict(datasets={"train": object(), "val": object()}), "eval datasets"),
        (dict(get_num_tokens_in_batch=len), "get_num_tokens_in_batch"),
        (
            dict(
                datasets={"a": object(), "b": object()},
                mixture={"sources": {"a": 10, "b": 10}, "stages": {"0dur": {"a": 0.5, "b": 0.5}}},
            ),
            "mixture=",
        ),
        (dict(precision="amp_fp16"), "fp16"),
    ],
)
def test_unsupported_combinations_are_refused_with_the_fix(over, named):
    with pytest.raises(ValueError, match="fault_tolerance") as error:
        RayTrainer(**_options(**over))
    assert named in str(error.value)
    assert "Fix:" in str(error.value)


def test_the_default_single_worker_is_refused_on_the_driver():
    options = _options()
    del options["num_workers"]
    with pytest.raises(ValueError, match="need num_workers >= 2"):
        RayTrainer(**options)


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'raytrain_events\[ft\]'"):
        RayTrainer(**_options())


def test_the_lighthouse_binds_loopback_when_ray_does():
    assert lighthouse_bind("127.0.0.1") == "127.0.0.1:0"
    assert lighthouse_bind("10.0.3.7") == "[::]:0"
