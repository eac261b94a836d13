"""Building algorithms by name: the registry's contract and its error messages."""

from __future__ import annotations

import pytest

from raytrain_events import Algorithm
from raytrain_events.algorithms import (
    EMA,
    LabelSmoothing,
    MixUp,
    available_algorithms,
    build_algorithm,
    build_algorithms,
    register_algorithm,
)
from raytrain_events.algorithms import registry as registry_module

SHIPPED = {
    "channels_last",
    "cutmix",
    "ema",
    "gradient_clipping",
    "label_smoothing",
    "layer_freezing",
    "mixup",
    "progressive_resizing",
    "seq_length_warmup",
    "stochastic_depth",
    "swa",
}


def test_every_shipped_algorithm_is_registered_and_builds_with_defaults():
    assert SHIPPED <= set(available_algorithms())
    for name in SHIPPED:
        assert isinstance(build_algorithm(name), Algorithm)


def test_specs_string_dict_instance_and_class_name():
    smoothing = build_algorithm({"name": "label_smoothing", "smoothing": 0.25})
    assert isinstance(smoothing, LabelSmoothing) and smoothing.smoothing == 0.25
    instance = EMA(smoothing=0.9)
    assert build_algorithm(instance) is instance
    assert isinstance(build_algorithm("MixUp"), MixUp)  # class-style name finds "mixup"
    built = build_algorithms(["mixup", {"name": "label_smoothing", "smoothing": 0.1}, instance])
    assert [type(a) for a in built] == [MixUp, LabelSmoothing, EMA] and built[2] is instance


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        build_algorithm("label_smooth")
    message = str(info.value)
    assert "label_smooth" in message and "label_smoothing" in message and "mixup" in message


def test_bad_kwargs_list_accepted_arguments():
    with pytest.raises(TypeError) as info:
        build_algorithm({"name": "label_smoothing", "smoothin": 0.1})
    message = str(info.value)
    assert "smoothin" in message and "smoothing=0.1" in message and "target_key" in message


def test_bad_specs():
    with pytest.raises(ValueError, match="no 'name'"):
        build_algorithm({"smoothing": 0.1})
    with pytest.raises(TypeError, match="Cannot build an algorithm"):
        build_algorithm(3)


def test_user_algorithm_registration(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_algorithm("scale_loss")
    class ScaleLoss(Algorithm):
        def __init__(self, factor: float):
            self.factor = factor

        def match(self, event, state):
            return False

        def apply(self, event, state, logger):
            return None

    algo = build_algorithm({"name": "scale_loss", "factor": 2.0})
    assert isinstance(algo, ScaleLoss) and algo.factor == 2.0
    assert "scale_loss" in available_algorithms()
    with pytest.raises(TypeError, match="factor"):
        build_algorithm("scale_loss")  # missing required argument: the message lists it
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("scale_loss")(type("Other", (ScaleLoss,), {}))
    with pytest.raises(TypeError, match="not an Algorithm"):
        register_algorithm("not_algo")(type("NotAlgo", (), {}))
