"""Mistakes users make (issue 39): each is refused before any work starts, with the problem and the fix.

One case per mistake, through the path users take: `Trainer(...)`, `RayTrainer(...).fit()`, the
command line and `sweep`. The `RayTrainer` cases must fail before Ray starts: the `no_ray` fixture
makes any start of Ray (``ray.init`` or ``ensure_ray``) fail the test instead, so none of these
tests needs Ray. ``bench/bad_input_latency.py`` times each `RayTrainer` case.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from bad_input_helpers import Net as _Net
from bad_input_helpers import no_ray  # noqa: F401 (a fixture)
from bad_input_helpers import ray_kwargs as _ray_kwargs
from bad_input_helpers import unread_dataset as _unread_dataset
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events.algorithms import LabelSmoothing
from raytrain_events.callbacks import SpeedMonitor
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.models import ClassifierModel
from raytrain_events.trainer.trainer import Trainer


def _model() -> ClassifierModel:
    return ClassifierModel(torch.nn.Linear(4, 3), num_classes=3)


def _rows(n: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator))


def _trainer_kwargs(model: torch.nn.Module, **over: Any) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(
        model=model,
        train_dataloader=DataLoader(_rows(), batch_size=8),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="1ep",
    )
    kwargs.update(over)
    return kwargs


def _other_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


# (id, changes to a good Trainer's arguments (a function of the model), error type, pattern naming the fix)
TRAINER_CASES: List[Tuple[str, Callable[[torch.nn.Module], Dict[str, Any]], type, str]] = [
    ("dataset-as-dataloader", lambda m: {"train_dataloader": _rows()}, TypeError, r"TensorDataset.*DataLoader\("),
    ("eval-dataloader-int", lambda m: {"eval_dataloader": 123}, TypeError, "not a dataloader.*DataLoader"),
    ("eval-dataset", lambda m: {"eval_dataloader": _rows()}, TypeError, "rows, not of batches.*DataLoader"),
    ("optimizer-factory", lambda m: {"optimizers": lambda model: None}, TypeError, "call the factory yourself"),
    ("optimizer-class", lambda m: {"optimizers": torch.optim.SGD}, TypeError, r"SGD\(model.parameters\(\)"),
    ("optimizer-foreign-params", lambda m: {"optimizers": _other_optimizer()}, ValueError, "model.parameters()"),
    (
        "scheduler-class",
        lambda m: {"schedulers": torch.optim.lr_scheduler.StepLR},
        TypeError,
        r"StepLR\(optimizer",
    ),
    (
        "scheduler-other-optimizer",
        lambda m: {"schedulers": torch.optim.lr_scheduler.StepLR(_other_optimizer(), 1)},
        ValueError,
        "never be scheduled.*same object",
    ),
    ("algorithm-twice", lambda m: {"algorithms": [LabelSmoothing(0.4), LabelSmoothing(0.4)]}, ValueError, "keep one"),
    ("algorithms-one-object", lambda m: {"algorithms": LabelSmoothing(0.1)}, TypeError, r"algorithms=\[LabelSmooth"),
    ("callbacks-one-object", lambda m: {"callbacks": SpeedMonitor()}, TypeError, r"callbacks=\[<"),
    ("loggers-by-name", lambda m: {"loggers": ["wandb"]}, TypeError, r"WandBLogger\("),
    ("loggers-a-class", lambda m: {"callbacks": [SpeedMonitor]}, TypeError, r"an instance: SpeedMonitor\("),
    ("run-name-parent", lambda m: {"run_name": ".."}, ValueError, "one folder name"),
    ("run-name-path", lambda m: {"run_name": "a/../../b"}, ValueError, "one folder name"),
    ("run-name-absolute", lambda m: {"run_name": "/tmp/x"}, ValueError, "one folder name"),
    ("run-name-empty", lambda m: {"run_name": ""}, ValueError, "one folder name"),
    (
        "autoresume-without-run-name",
        lambda m: {"checkpoint": CheckpointConfig(autoresume=True)},
        ValueError,
        r"run_name='my-run'",
    ),
    (
        "save-interval-tokens-without-counter",
        lambda m: {"checkpoint": CheckpointConfig(save_interval="10tok")},
        ValueError,
        "get_num_tokens_in_batch",
    ),
    (
        "local-tier-a-file",
        lambda m: {"checkpoint": CheckpointConfig(local_dir=__file__ + "/nvme")},
        ValueError,
        r"is a file, not a directory.*Fix: pass a node-local directory",
    ),
]
if not torch.cuda.is_available():
    TRAINER_CASES.append(("cuda-on-cpu-build", lambda m: {"device": "cuda"}, ValueError, "device='cpu'"))


@pytest.mark.parametrize(
    "changes, error, fix", [case[1:] for case in TRAINER_CASES], ids=[case[0] for case in TRAINER_CASES]
)
def test_trainer_refuses_at_construction_naming_the_fix(tmp_path, monkeypatch, changes, error, fix):
    monkeypatch.chdir(tmp_path)  # a default save folder is ./runs/<run_name>/checkpoints
    model = _model()
    with pytest.raises(error, match=fix):
        Trainer(**_trainer_kwargs(model, **changes(model)))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("manifest.json"))


# CheckpointConfig's own checks (no Trainer needed).
@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"keep": "2"}, r"keep=3"),
        ({"save_every_n_steps": 2.5}, r"save_every_n_steps=3"),
        ({"keep_best": "1", "metric": "m"}, r"keep_best=3"),
        ({"save_every_n_seconds": "60"}, r"save_every_n_seconds=600"),
    ],
    ids=["keep-str", "steps-float", "keep-best-str", "seconds-str"],
)
def test_checkpoint_config_refuses_wrong_types(kwargs, fix):
    with pytest.raises(TypeError, match=fix):
        CheckpointConfig(**kwargs)


def test_save_folder_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    model = _model()
    with pytest.raises(OSError, match="is a file, not a folder.*point save_folder"):
        Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(save_folder=str(file))))


def test_load_from_a_file_inside_a_checkpoint_names_its_folder(tmp_path):
    model = _model()
    folder = tmp_path / "ckpts"
    Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(save_folder=str(folder)))).fit()
    state_file = next(folder.rglob("state.pt"))
    model = _model()
    with pytest.raises(OSError, match=f"load_from=.*is a file.*{state_file.parent.name}"):
        Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(load_from=str(state_file))))


@pytest.mark.parametrize("count", [None, 2.5, torch.tensor(3.0)], ids=["none", "float", "float-tensor"])
def test_a_token_counter_must_return_an_integer(count):
    model = _model()
    loader = DataSpec(DataLoader(_rows(), batch_size=8), get_num_tokens_in_batch=lambda batch: count)
    with pytest.raises(TypeError, match=r"must return the batch's token count as an int.*int\("):
        Trainer(**_trainer_kwargs(model, train_dataloader=loader)).fit()


def test_integer_token_counts_are_counted():
    model = _model()
    loader = DataSpec(DataLoader(_rows(), batch_size=8), get_num_tokens_in_batch=lambda batch: torch.tensor(5))
    assert Trainer(**_trainer_kwargs(model, train_dataloader=loader)).fit().timestamp.token.value == 10


def test_an_optimizer_over_some_foreign_tensors_warns_once(caplog):
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    with caplog.at_level("WARNING", logger="raytrain_events.trainer.arguments"):
        Trainer(**_trainer_kwargs(model, optimizers=optimizer))
    assert [r.getMessage() for r in caplog.records if "not parameters of the model" in r.getMessage()]


def test_two_jobs_with_default_names_never_share_checkpoints(tmp_path, monkeypatch):
    """Two jobs started in one directory with the default save folder: each gets its own run folder."""
    monkeypatch.chdir(tmp_path)
    folders = []
    for _ in range(2):
        model = _model()
        trainer = Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(save_interval="1ep")))
        trainer.fit()
        folders.append(trainer.state.run_name)
    assert folders[0] != folders[1] and all(name.startswith("run-") for name in folders)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(folders)
    # Continuing a run is explicit: the same run_name with autoresume.
    model = _model()
    resumed = Trainer(**_trainer_kwargs(model, run_name=folders[0], checkpoint=CheckpointConfig(autoresume=True)))
    assert resumed.state.timestamp.epoch.value == 1


# ------------------------------------------------------------------------------------ RayTrainer
def _foreign_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


# (id, changes to good RayTrainer arguments, error type, pattern naming the fix)
RAY_TRAINER_CASES: List[Tuple[str, Callable[[], Dict[str, Any]], type, str]] = [
    ("model-instance", lambda: {"model": _Net()}, TypeError, r"model=lambda: Net\("),
    ("model-factory-returns-data", lambda: {"model": lambda: {"w": 1}}, TypeError, "return the model"),
    (
        "optimizer-instance",
        lambda: {"optimizers": torch.optim.SGD(_Net().parameters(), lr=0.1)},
        TypeError,
        r"optimizers=lambda model: torch.optim",
    ),
    ("optimizer-class", lambda: {"optimizers": torch.optim.AdamW}, TypeError, r"AdamW\(model.parameters\(\)"),
    ("optimizer-foreign-params", lambda: {"optimizers": _foreign_optimizer}, ValueError, "model.parameters()"),
    ("scheduler-class", lambda: {"schedulers": torch.optim.lr_scheduler.StepLR}, TypeError, r"StepLR\(optimizer"),
    ("algorithm-typo", lambda: {"algorithms": ["label_smothing"]}, ValueError, "Did you mean 'label_smoothing'"),
    ("algorithm-twice", lambda: {"algorithms": ["label_smoothing", "label_smoothing"]}, ValueError, "keep one"),
    ("algorithms-a-string", lambda: {"algorithms": "label_smoothing"}, TypeError, r"algorithms=\['label_smoothing'\]"),
    ("datasets-list", lambda: {"datasets": {"train": [{"x": 1}]}}, TypeError, r"ray.data.read_parquet"),
    ("columns-a-string", lambda: {"columns": "image"}, TypeError, r"columns=\['image'\]"),
    ("resources-a-string", lambda: {"resources_per_worker": "2 cpus"}, TypeError, r"\{'CPU': 2\}"),
    ("storage-unknown-protocol", lambda: {"storage_path": "s4://bucket/runs"}, OSError, "s4.*known protocol"),
    ("run-name-parent", lambda: {"run_name": ".."}, ValueError, "one folder name"),
    ("run-name-path", lambda: {"run_name": "x/y"}, ValueError, "one folder name"),
    ("run-name-empty", lambda: {"run_name": ""}, ValueError, "one folder name"),
    (
        "autoresume-without-run-name",
        lambda: {"run_name": None, "checkpoint": CheckpointConfig(autoresume=True)},
        ValueError,
        r"run_name='my-run'",
    ),
    (
        "local-tier-not-writable",
        lambda: {"checkpoint": CheckpointConfig(local_dir="/proc/raytrain-local-tier")},
        ValueError,
        r"local_dir=.*not writable.*Fix: pass a node-local directory",
    ),
    (
        "local-tier-object-storage",
        lambda: {"checkpoint": CheckpointConfig(local_dir="s3://bucket/nvme")},
        ValueError,
        r"not a local path.*Fix: pass a node-local directory",
    ),
]


@pytest.mark.parametrize(
    "changes, error, fix", [case[1:] for case in RAY_TRAINER_CASES], ids=[case[0] for case in RAY_TRAINER_CASES]
)
def test_ray_trainer_refuses_before_ray_starts(tmp_path, no_ray, changes, error, fix):  # noqa: F811 (the fixture)
    from raytrain_events.ray.driver import RayTrainer

    with pytest.raises(error, match=fix):
        RayTrainer(**_ray_kwargs(**{"storage_path": str(tmp_path), **changes()})).fit()
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_ray_trainer_default_run_names_are_unique(tmp_path):
    from raytrain_events.ray.driver import RayTrainer

    names = {RayTrainer(**_ray_kwargs(run_name=None, storage_path=str(tmp_path))).run_name for _ in range(3)}
    assert len(names) == 3 and all(name.startswith("run-") for name in names)


def test_sweep_name_must_stay_inside_the_storage_folder(tmp_path, no_ray):  # noqa: F811 (the fixture)
    from raytrain_events.tune import sweep

    with pytest.raises(ValueError, match="name='..' .*one folder name"):
        sweep(
            trainer={k: v for k, v in _ray_kwargs().items() if k != "run_name"},
            param_space={},
            metric="metrics/eval/accuracy",
            mode="max",
            storage_path=str(tmp_path),
            name="..",
        )


@pytest.mark.parametrize("run_name", ["..", "a/b", "/abs"])
def test_cli_refuses_a_run_name_that_leaves_the_storage_folder(tmp_path, monkeypatch, capsys, no_ray, run_name):  # noqa: F811 (the fixture)
    from raytrain_events.cli.main import main

    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "store"
    code = main(["train", f"storage={storage}", f"run_name={run_name}", "progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and "one folder name" in err, err
    assert os.listdir(tmp_path) == []  # nothing written: not ./data, not the storage folder


# ---------------------------------------------------------------------------------- loading checkpoints
def _saved_checkpoint(tmp_path, **over: Any) -> str:
    """A committed checkpoint of a 1-epoch run (2 batches) in ``tmp_path/ckpts``; returns the folder."""
    folder = str(tmp_path / "ckpts")
    model = over.pop("model", None) or _model()
    Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(save_folder=folder), **over)).fit()
    return folder


def test_a_checkpoint_of_another_shape_names_a_fix_that_works(tmp_path):
    folder = _saved_checkpoint(tmp_path)
    wider = ClassifierModel(torch.nn.Linear(4, 5), num_classes=5)
    for strict in (True, False):  # the advice must not be load_strict=False, which fails the same way
        with pytest.raises(Exception, match="shape mismatch.*load_ignore_keys.*load_strict=False does not help"):
            Trainer(**_trainer_kwargs(wider, checkpoint=CheckpointConfig(load_from=folder, load_strict=strict)))
    # The fix it names works: the changed layer starts fresh, the rest loads.
    Trainer(
        **_trainer_kwargs(
            wider,
            checkpoint=CheckpointConfig(load_from=folder, load_ignore_keys=["model/module.*"], load_weights_only=True),
        )
    )


def test_an_sgd_checkpoint_into_adam_is_refused_before_loading(tmp_path):
    folder = _saved_checkpoint(tmp_path)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(Exception, match=r"does not fit this run's Adam.*'betas'.*load_ignore_keys=\['optimizers'"):
        Trainer(**_trainer_kwargs(model, optimizers=adam, checkpoint=CheckpointConfig(load_from=folder)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was loaded
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    config = CheckpointConfig(load_from=folder, load_ignore_keys=["optimizers", "schedulers"])
    Trainer(**_trainer_kwargs(model, optimizers=adam, checkpoint=config)).fit()  # the fix it names trains


def test_loading_a_checkpoint_past_max_duration_says_nothing_will_train(tmp_path, caplog):
    folder = _saved_checkpoint(tmp_path, max_duration="2ba")
    model = _model()
    with caplog.at_level("WARNING", logger="raytrain_events.checkpoint.run.loading"):
        trainer = Trainer(**_trainer_kwargs(model, max_duration="1ba", checkpoint=CheckpointConfig(load_from=folder)))
    warned = [r.getMessage() for r in caplog.records if "fit() will train nothing" in r.getMessage()]
    assert len(warned) == 1 and "raise max_duration" in warned[0] and "load_weights_only=True" in warned[0]
    assert trainer.fit().timestamp.batch.value == 2  # correct behaviour: nothing more trained


def test_an_edited_manifest_timestamp_is_refused(tmp_path):
    import json

    _saved_checkpoint(tmp_path)
    manifest = next((tmp_path / "ckpts").rglob("manifest.json"))
    data = json.loads(manifest.read_text())
    data["timestamp"]["batch"] = 999
    manifest.write_text(json.dumps(data))
    model = _model()
    with pytest.raises(
        Exception, match=r"inconsistent: its manifest.json lists \{'batch': 999\}.*holds \{'batch': 2\}"
    ):
        Trainer(**_trainer_kwargs(model, checkpoint=CheckpointConfig(load_from=str(manifest.parent))))


# ---------------------------------------------------------------------- RayTrainer(mixture=...)
@pytest.fixture(scope="module")
def mixture_sources(tmp_path_factory) -> Dict[str, Any]:
    """Three small Parquet sources (ids, 3 int32 tokens per row) and one with another schema (int64 tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    folder = tmp_path_factory.mktemp("mixture-sources")
    sources: Dict[str, Any] = {}
    for name, rows, kind in (
        ("web", 40, pa.int32()),
        ("code", 30, pa.int32()),
        ("math", 20, pa.int32()),
        ("other", 20, pa.int64()),
    ):
        path = str(folder / f"{name}.parquet")
        pq.write_table(pa.table({"id": list(range(rows)), "tokens": pa.array([[1] * 3] * rows, pa.list_(kind))}), path)
        sources[name] = ParquetRowGroups(path)
    return sources


def _mixture(**over: Any) -> Dict[str, Any]:
    mixture: Dict[str, Any] = {
        "sources": {"web": 40, "code": 30, "math": 20},
        "stages": {"0dur": {"web": 0.5, "code": 0.3, "math": 0.2}, "0.5dur": {"web": 0.2, "code": 0.3, "math": 0.5}},
    }
    mixture.update(over)
    return mixture


# (id, mixture, datasets -> datasets, error type, pattern naming the fix)
MIXTURE_CASES: List[Tuple[str, Dict[str, Any], Callable[[Dict[str, Any]], Dict[str, Any]], type, str]] = [
    ("negative-weight", _mixture(stages={"0dur": {"web": -0.1, "code": 1}}), dict, ValueError, "must be >= 0"),
    ("weights-sum-to-0", _mixture(stages={"0dur": {"web": 0, "code": 0}}), dict, ValueError, "summing to 0"),
    (
        "stage-after-the-end",
        _mixture(stages={"0dur": {"web": 1}, "1.5dur": {"code": 1}}),
        dict,
        ValueError,
        r"\[0, 1\)",
    ),
    (
        "source-not-in-datasets",
        _mixture(),
        lambda d: {k: v for k, v in d.items() if k != "math"},
        ValueError,
        r"\['math'\] are not in datasets.*datasets=\{name: ParquetRowGroups",
    ),
    ("source-of-another-schema", _mixture(), lambda d: {**d, "math": d["other"]}, ValueError, "convert it first"),
    ("wrong-row-count", _mixture(sources={"web": 41, "code": 30, "math": 20}), dict, ValueError, r"'web': 40"),
    ("train-beside-a-mixture", _mixture(), lambda d: {**d, "train": d["web"]}, ValueError, "leave 'train' out"),
    # Mixture(online=...): weights that adapt during the run (core/mixture_online.py)
    (
        "online-on-absolute-amounts",
        _mixture(stages={"0dur": {"web": {"repeat": 1}, "code": {"choose": 10}}}, online={"policy": "exp3"}),
        dict,
        ValueError,
        "give its weights as proportions",
    ),
    (
        "online-unknown-policy",
        _mixture(weights={"web": 1}, stages=None, online={"policy": "ucb"}),
        dict,
        ValueError,
        r"use one of \['exp3', 'doremi', 'target'\]",
    ),
    (
        "online-zero-rate",
        _mixture(weights={"web": 1}, stages=None, online={"policy": "exp3", "rate": 0}),
        dict,
        ValueError,
        "rate=0 must be a positive",
    ),
    (
        "online-negative-rate",
        _mixture(weights={"web": 1}, stages=None, online={"policy": "exp3", "rate": -1.0}),
        dict,
        ValueError,
        "rate=-1.0 must be a positive",
    ),
    ("online-beside-fixed-stages", _mixture(online={"policy": "exp3"}), dict, ValueError, "give one stage"),
    (
        "online-target-without-its-eval-set",
        _mixture(weights={"web": 1}, stages=None, online={"policy": "target", "target": "heldout"}),
        dict,
        ValueError,
        r"online policy 'target'.*no eval set evaluated in the loop is named 'heldout'.*datasets=\{'heldout'",
    ),
    (
        "online-without-source-evals",
        _mixture(weights={"web": 1}, stages=None, online={"policy": "exp3"}),
        dict,
        ValueError,
        r"have no eval set evaluated in the loop.*online=\{'evaluators'",
    ),
]


@pytest.mark.parametrize(
    "mixture, pick, error, fix", [case[1:] for case in MIXTURE_CASES], ids=[case[0] for case in MIXTURE_CASES]
)
def test_a_bad_mixture_is_refused_before_ray_starts(tmp_path, no_ray, mixture_sources, mixture, pick, error, fix):  # noqa: F811 (the fixture)
    from raytrain_events.ray.driver import RayTrainer

    datasets = {k: v for k, v in pick(dict(mixture_sources)).items() if k != "other"}  # "other": another schema
    with pytest.raises(error, match=fix):
        RayTrainer(**_ray_kwargs(storage_path=str(tmp_path), datasets=datasets, mixture=mixture)).fit()
    assert not any(tmp_path.iterdir())  # no run directory was made


@pytest.mark.parametrize(
    "over, fix",
    [
        ({"validation": "async"}, r"have no eval set evaluated in the loop.*not by validation="),
    ],
    ids=["online-source-eval-by-validation-tasks"],
)
def test_an_online_mixture_whose_source_evals_are_not_in_the_loop_is_refused_before_ray_starts(
    tmp_path,
    no_ray,  # noqa: F811 (the fixture)
    mixture_sources,
    over,
    fix,
):
    from raytrain_events.ray.driver import RayTrainer

    evals = {f"{name}_eval": _unread_dataset() for name in ("web", "code", "math")}
    datasets = {**{k: v for k, v in mixture_sources.items() if k != "other"}, **evals}
    mixture = _mixture(
        weights={"web": 1, "code": 1, "math": 1},
        stages=None,
        online={"policy": "exp3", "evaluators": {n: f"{n}_eval" for n in ("web", "code", "math")}},
    )
    from raytrain_events.checkpoint import CheckpointConfig

    checkpoint = {"checkpoint": CheckpointConfig(save_interval="1ep")} if "validation" in over else {}
    with pytest.raises(ValueError, match=fix):
        RayTrainer(
            **_ray_kwargs(storage_path=str(tmp_path), datasets=datasets, mixture=mixture, **checkpoint, **over)
        ).fit()
    assert not any(tmp_path.iterdir())
