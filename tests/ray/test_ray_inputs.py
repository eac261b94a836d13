"""Bad input to RayTrainer fails on the driver before any worker starts (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from raytrain_events.data.ray.loader import pick_columns
from raytrain_events.ray.driver import RayTrainer


def _kwargs(**over):
    base = dict(model=lambda: None, optimizers=lambda m: None, datasets={"train": object()}, max_duration="1ep")
    base.update(over)
    return base


def test_missing_train_dataset_is_named():
    with pytest.raises(ValueError, match="no 'train' entry.*eval"):
        RayTrainer(**_kwargs(datasets={"eval": object()}))


def test_num_workers_below_one():
    with pytest.raises(ValueError, match="num_workers=0 must be an integer >= 1"):
        RayTrainer(**_kwargs(num_workers=0))


def test_bad_durations():
    with pytest.raises(ValueError, match="Invalid time string"):
        RayTrainer(**_kwargs(max_duration="ten epochs"))
    with pytest.raises(ValueError, match="give it in 'ep'"):
        RayTrainer(**_kwargs(max_duration="0.5dur"))
    with pytest.raises(ValueError, match="get_num_tokens_in_batch"):
        RayTrainer(**_kwargs(max_duration="1000tok"))


def test_memory_storage_is_refused_for_ray_runs():
    with pytest.raises(ValueError, match="memory:// storage lives inside one process"):
        RayTrainer(**_kwargs(storage_path="memory://x"))


def test_missing_columns_fail_on_first_batch_naming_found_columns():
    batch = {"features": torch.zeros(2, 3), "label": torch.zeros(2)}
    with pytest.raises(KeyError, match=r"no column\(s\) \['x', 'y'\].*\['features', 'label'\]"):
        pick_columns(batch, ["x", "y"])


def test_columns_restrict_the_batch_to_those_columns():
    """``columns=[...]``: "only these columns reach the batch", for a dict batch and an Arrow table."""
    import pyarrow as pa

    batch = {"features": torch.zeros(2, 3), "label": torch.zeros(2), "id": torch.arange(2)}
    assert list(pick_columns(batch, ["label", "features"])) == ["label", "features"]
    table = pa.table({"a": [1, 2], "b": [3, 4], "c": [5, 6]})
    assert pick_columns(table, ["c", "a"]).column_names == ["c", "a"]
