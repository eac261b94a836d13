"""Checkpoint pointers (what trials report to Tune instead of their checkpoints), without Ray."""

from __future__ import annotations

import json
import os

import pytest

from raytrain_events.tune.pointer import (
    POINTER_FILE,
    CheckpointPointer,
    pointer_from_entry,
    read_pointer,
    write_pointer,
)


def test_an_entry_naming_a_checkpoint_gives_its_url_and_exact_counters(tmp_path):
    entry = {
        "time/epoch": 1,
        "time/batch": 12,
        "time/sample": 384,
        "time/token": 0,
        "checkpoint_path": "bucket/sweep/trial_a/train/checkpoints/ckpt-12-ab12",
    }
    algorithms = [{"name": "label_smoothing", "smoothing": 0.1}]
    pointer = pointer_from_entry(entry, "s3://bucket/sweep/trial_a/train", "trial_a", "train", algorithms)
    assert pointer == CheckpointPointer(
        url="s3://bucket/sweep/trial_a/train/checkpoints/ckpt-12-ab12",  # the scheme comes from the run URL
        counters={"epoch": 1, "batch": 12, "sample": 384, "token": 0},
        trial_folder="trial_a",
        run_name="train",
        algorithms=algorithms,
    )
    assert pointer.name == "ckpt-12-ab12"
    assert pointer_from_entry({"time/batch": 3}, "s3://b/r", "trial_a", "train", []) is None

    path = write_pointer(str(tmp_path / "ckpt"), pointer)
    assert os.listdir(tmp_path / "ckpt") == [POINTER_FILE] and os.path.getsize(path) < 1000  # no model bytes
    assert read_pointer(str(tmp_path / "ckpt")) == pointer


def test_a_folder_without_a_pointer_or_a_torn_one_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="not reported by a raytrain_events sweep trial"):
        read_pointer(str(tmp_path))
    (tmp_path / POINTER_FILE).write_text(json.dumps({"url": "s3://b/c"}))
    with pytest.raises(ValueError, match="lacks counters, run_name, trial_folder"):
        read_pointer(str(tmp_path))
