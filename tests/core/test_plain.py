"""The one plain-data converter (core/plain.py): tensors, numpy, OmegaConf, dataclasses -> Python data."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np
import torch
from omegaconf import OmegaConf

from raytrain_events.core.plain import describe_value, to_plain, to_python
from raytrain_events.core.time import Time


@dataclasses.dataclass
class Inner:
    lr: float = 0.1
    every: Time = dataclasses.field(default_factory=lambda: Time.from_timestring("2ep"))


def make_model():
    return None


def test_to_plain_turns_everything_into_json_data():
    value = {
        "t0": torch.tensor(1.5),
        "t1": torch.tensor([1, 2]),
        "np": np.float32(0.25),
        "arr": np.arange(3),
        "cfg": OmegaConf.create({"a": 1, "b": "${a}"}),
        "dc": Inner(),
        "tuple": (1, "x", None, True),
        3: float("nan"),
        "obj": object,
    }
    out = to_plain(value)
    assert out["t0"] == 1.5 and out["t1"] == [1, 2] and out["np"] == 0.25 and out["arr"] == [0, 1, 2]
    assert out["cfg"] == {"a": 1, "b": 1}  # resolved by default
    assert out["dc"] == {"lr": 0.1, "every": "2ep"}
    assert out["tuple"] == [1, "x", None, True] and math.isnan(out["3"])
    assert out["obj"] == str(object)
    assert type(out["np"]) is float and type(out["t1"][0]) is int
    json.dumps(out)  # nothing left that JSON cannot hold
    assert to_plain(OmegaConf.create({"a": 1, "b": "${a}"}), resolve=False) == {"a": 1, "b": "${a}"}
    marker = object()
    assert to_plain([marker], fallback=lambda v: v) == [marker]  # a custom fallback keeps the object


def test_to_python_only_touches_one_element_values():
    assert to_python(torch.tensor([2.0])) == 2.0 and to_python(np.int64(3)) == 3
    t = torch.tensor([1.0, 2.0])
    assert to_python(t) is t and to_python("x") == "x"


def test_describe_value_names_functions_without_addresses():
    described = describe_value({"f": make_model, "p": functools.partial(make_model), "o": Inner, "i": Inner()})
    assert described == {
        "f": f"{__name__}.make_model",
        "p": f"partial({__name__}.make_model)",
        "o": f"{__name__}.Inner",
        "i": {"lr": 0.1, "every": "2ep"},
    }
    assert describe_value(torch.nn.Linear(1, 1)) == "Linear"


def test_flatten_joins_nested_keys_with_the_separator():
    from raytrain_events.core.plain import flatten

    nested = {"optim": {"lr": 0.1, "betas": {"b1": 0.9}}, "seed": 3}
    assert flatten(nested) == {"optim.lr": 0.1, "optim.betas.b1": 0.9, "seed": 3}
    assert flatten(nested, sep="/") == {"optim/lr": 0.1, "optim/betas/b1": 0.9, "seed": 3}
    assert flatten({}) == {}
