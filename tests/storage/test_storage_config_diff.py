"""config_diff.py: ml-starter style config differences."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from raytrain_events.storage.config_diff import diff_configs, format_config_diff


def test_equal_configs_have_no_diff():
    cfg = OmegaConf.create({"a": 1, "b": {"c": [1, {"d": None}]}})
    assert diff_configs(cfg, cfg.copy()) == ([], [])
    assert format_config_diff(cfg, cfg.copy()) == ""


def test_changed_nested_value():
    first = OmegaConf.create({"model": {"hidden": 64, "act": "relu"}, "lr": 0.1})
    second = OmegaConf.create({"model": {"hidden": 128, "act": "relu"}, "lr": 0.1})
    assert diff_configs(first, second) == (["model.hidden: 64"], ["model.hidden: 128"])
    assert format_config_diff(first, second) == "- model.hidden: 64\n+ model.hidden: 128"


def test_keys_only_on_one_side_are_listed_on_that_side():
    first = OmegaConf.create({"a": 1, "old": {"x": True}})
    second = OmegaConf.create({"a": 1, "new": None})
    old, new = diff_configs(first, second)
    assert old == ['old: {"x": true}']
    assert new == ["new: null"]


def test_lists_compare_per_index_and_extra_items():
    first = OmegaConf.create({"sizes": [1, 2, 3], "blocks": [{"k": 1}]})
    second = OmegaConf.create({"sizes": [1, 5], "blocks": [{"k": 2}]})
    old, new = diff_configs(first, second)
    assert old == ["sizes.1: 2", "sizes.2: 3", "blocks.0.k: 1"]
    assert new == ["sizes.1: 5", "blocks.0.k: 2"]


def test_type_change_missing_value_and_interpolation_are_reported_unresolved():
    first = OmegaConf.create({"n": 1, "m": "???", "ref": "${n}"})
    second = OmegaConf.create({"n": 1.0, "m": 3, "ref": "${other}"})
    old, new = diff_configs(first, second)
    assert old == ["n: 1", "m: ???", "ref: ${n}"]
    assert new == ["n: 1.0", "m: 3", "ref: ${other}"]


def test_plain_dicts_dataclasses_and_prefix():
    @dataclasses.dataclass
    class Opt:
        lr: float = 0.1
        betas: tuple = (0.9, 0.99)

    assert diff_configs(Opt(), {"lr": 0.2, "betas": [0.9, 0.99]}, prefix="optim") == (
        ["optim.lr: 0.1"],
        ["optim.lr: 0.2"],
    )
