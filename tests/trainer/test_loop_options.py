"""`LoopOptions`: one definition of the loop options, the same for `Trainer` and `RunSpec` (no Ray started)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.core.precision import Precision
from raytrain_events.core.time import Time
from raytrain_events.models import ClassifierModel
from raytrain_events.ray.driver import RayTrainer
from raytrain_events.ray.spec import RunSpec, option_names
from raytrain_events.trainer.options import LoopOptions, loop_option_names

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "raytrain_events"


def model():
    return ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)


def loader():
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def trainer(**kw):
    m = kw.pop("model", None) or model()
    return Trainer(model=m, train_dataloader=loader(), optimizers=torch.optim.SGD(m.parameters(), lr=0.1), **kw)


def spec(**over):
    base = dict(model=model, optimizers=lambda m: None, datasets={"train": object()}, max_duration="1ep")
    return RunSpec(**{**base, **over})


def test_run_spec_has_the_loop_options_with_the_same_defaults_and_help():
    """One definition: RunSpec inherits each LoopOptions field (not a copy with its own default)."""
    spec_fields = {f.name: f for f in dataclasses.fields(RunSpec)}
    for f in dataclasses.fields(LoopOptions):
        assert spec_fields[f.name] is not None and spec_fields[f.name].metadata["help"] == f.metadata["help"]
        assert spec_fields[f.name].default == f.default and spec_fields[f.name].default_factory == f.default_factory
    assert set(loop_option_names()) <= set(option_names())
    assert issubclass(RunSpec, LoopOptions)
    # The seed default is one value, 0, in both (see trainer/options.py for why).
    assert LoopOptions().seed == 0 and spec().seed == 0 and trainer(max_duration="1ep").state.seed == 0


def test_trainer_keywords_and_an_options_object_build_the_same_loop():
    by_keywords = trainer(max_duration="3ba", grad_accum=2, precision="amp_bf16", seed=5, config={"lr": 0.1})
    options = LoopOptions(max_duration="3ba", grad_accum=2, precision="amp_bf16", seed=5, config={"lr": 0.1})
    by_object = trainer(options=options)
    assert by_keywords.options == by_object.options == options
    for t in (by_keywords, by_object):
        assert t.state.max_duration == Time(3, "ba") and t.state.grad_accum == 2 and t.state.seed == 5
        assert t.state.precision is Precision.AMP_BF16 and t.config == {"lr": 0.1}
    # Keywords replace the object's fields; the object itself is left as it was.
    mixed = trainer(options=options, grad_accum=1)
    assert mixed.state.grad_accum == 1 and mixed.state.max_duration == Time(3, "ba") and options.grad_accum == 2


def test_values_the_loop_needs_are_resolved_once_on_the_options():
    auto = LoopOptions(grad_accum="auto", parallelism="fsdp", compile={"mode": "default"})
    assert auto.auto_microbatching and auto.initial_grad_accum == 1
    assert auto.parallelism_spec.sharded and auto.compile_kwargs == {"mode": "default"}
    plain = dataclasses.replace(auto, grad_accum=4, parallelism="ddp", compile=False)  # resolved again
    assert not plain.auto_microbatching and plain.initial_grad_accum == 4
    assert not plain.parallelism_spec.sharded and plain.compile_kwargs is None
    assert spec(grad_accum="auto").describe()["grad_accum"] == "auto"  # the config keeps the value as given


def test_default_seed_makes_two_trainers_repeat_and_none_leaves_the_generators_alone():
    trainer(max_duration="1ep")
    first = torch.rand(3)
    trainer(max_duration="1ep")
    assert torch.equal(torch.rand(3), first)  # seeded with 0 + rank by default
    m = model()  # built before the generator is set: only the Trainer runs in between
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Trainer(model=m, train_dataloader=[], optimizers=torch.optim.SGD(m.parameters(), lr=0.1), max_duration=1, seed=None)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"grad_accum": 0}, "grad_accum=0 must be an integer >= 1"),
        ({"precision": "fp8"}, "Unknown precision 'fp8'"),
        ({"seed": "7"}, "seed='7' must be an integer"),
        ({"seed": True}, "seed=True must be an integer"),
        ({"max_duration": "0.5dur"}, "fraction of the run"),
        ({"max_duration": "0ep"}, "must be positive"),
        ({"parallelism": "tp"}, "parallelism='tp' is not supported"),
        ({"compile": "yes"}, "compile"),
        ({"eval_interval": "often"}, "often"),
        ({"config": [1]}, "config=\\[1\\] must be a dict"),
    ],
)
def test_bad_loop_options_fail_the_same_way_in_trainer_and_run_spec(options, match):
    for build in (lambda: LoopOptions(**options), lambda: trainer(**{"max_duration": "1ep", **options})):
        with pytest.raises((ValueError, TypeError), match=match):
            build()
    if "max_duration" not in options:
        with pytest.raises((ValueError, TypeError), match=match):
            spec(**options)


def test_trainer_names_its_loop_options_for_an_unknown_keyword():
    with pytest.raises(TypeError, match=r"'grad_accumulation', which is not an argument.*grad_accum, precision"):
        trainer(max_duration="1ep", grad_accumulation=2)
    with pytest.raises(TypeError, match="options must be a LoopOptions"):
        trainer(options={"max_duration": "1ep"})


def test_tokens_need_a_counter_where_the_data_is_known():
    with pytest.raises(ValueError, match="no token counter"):
        trainer(max_duration="100tok")
    with pytest.raises(ValueError, match="get_num_tokens_in_batch"):
        spec(max_duration="100tok")
    assert spec(max_duration="100tok", get_num_tokens_in_batch=len).max_duration == Time(100, "tok")


def test_a_trainer_given_a_run_spec_uses_its_checked_options_as_they_are():
    """The Ray worker passes its RunSpec as the Trainer's options: nothing mapped by hand, nothing checked again."""
    run = spec(max_duration="2ba", grad_accum=2, precision="amp_bf16", seed=3, config={"k": 1})
    t = trainer(options=run)
    assert t.options is run
    assert t.state.max_duration == Time(2, "ba") and t.state.grad_accum == 2 and t.state.seed == 3
    assert t.state.precision is Precision.AMP_BF16 and t.config == {"k": 1}


def test_run_spec_loggers_was_renamed_driver_loggers():
    for build in (
        lambda: spec(loggers=[]),
        lambda: RayTrainer(model=model, optimizers=lambda m: None, datasets={"train": 1}, max_duration=1, loggers=[]),
        lambda: spec().replace(loggers=[]),
        lambda: RayTrainer(spec(), loggers=[]),
    ):
        with pytest.raises(TypeError, match="'loggers', which was renamed 'driver_loggers': pass driver_loggers="):
            build()
    assert spec(driver_loggers=[1]).reports.driver_loggers == [1]
    assert "loggers" not in option_names()
    with pytest.raises(TypeError, match="'nonsense', which is not a RayTrainer argument"):
        spec(nonsense=1)  # RunSpec(...) itself names the options, not only RayTrainer(...)


def test_run_spec_requires_max_duration():
    with pytest.raises(TypeError, match="RayTrainer needs max_duration"):
        spec(max_duration=None)
    with pytest.raises(TypeError, match="needs max_duration"):
        RayTrainer(model=model, optimizers=lambda m: None, datasets={"train": 1})


def test_loop_helpers_do_not_take_the_trainer():
    """Helpers get narrow inputs (protocols, State, callables): none of them imports the Trainer."""
    helpers = [p for p in (PACKAGE / "trainer").glob("*.py") if p.name not in ("trainer.py", "__init__.py")]
    assert len(helpers) >= 10
    for path in helpers:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "raytrain_events.trainer.trainer", f"{path.name} imports the Trainer"
                assert not (node.module == "raytrain_events.trainer" and any(a.name == "Trainer" for a in node.names))
