"""Mistakes users make, round three (issue 48), through the other entry points: `sweep`, the CLI, `Trainer`.

`sweep` checks its trials' base run, every value ``param_space["trainer"]`` lists (and their
combinations), the metric's eval set, the storage and PBT's checkpoints before Ray starts
(``tune/sweep_checks.py``); the CLI's digits job runs every check before it starts Ray; the local
`Trainer` and the core types refuse what used to crash or train wrongly. Ray's start is patched to
fail (`no_ray`) wherever a refusal must come first.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import numpy as np
import pytest
import torch
from bad_input_helpers import no_ray, ray_kwargs, unread_dataset  # noqa: F401 (no_ray: a fixture)
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.mixture import Mixture, MixtureError


# ------------------------------------------------------------------------------------------ sweep
def _sweep(tmp_path, **over: Any) -> None:
    from raytrain_events.tune import sweep

    trainer = {k: v for k, v in ray_kwargs().items() if k != "run_name"}
    trainer["datasets"] = {"train": unread_dataset(), "val": unread_dataset()}
    arguments: Dict[str, Any] = dict(
        trainer=trainer, param_space={}, metric="metrics/val/accuracy", mode="max", storage_path=str(tmp_path / "s")
    )
    arguments.update(over)
    sweep(**arguments)


def _grid(*values: Any) -> Dict[str, Any]:
    return {"grid_search": list(values)}


@pytest.mark.parametrize(
    "over, error, fix",
    [
        ({"metric": "metrics/eval/accuracy"}, ValueError, r"eval set 'eval', which this run does not have.*\['val'\]"),
        ({"metric": "metrics/test/loss"}, ValueError, r"metric='metrics/val/loss'"),
        ({"param_space": {"trainer": {"batch_size": _grid(32, 0)}}}, ValueError, r"batch_size=0, which no trial"),
        ({"param_space": {"trainer": {"max_duration": _grid("2ep", "1.5ep")}}}, TypeError, r"max_duration='1.5ep'"),
        (
            {"param_space": {"trainer": {"num_workers": _grid(2, 4), "global_batch_size": _grid(3, 8)}}},
            ValueError,
            r"num_workers=4, global_batch_size=3.*smaller than the 4",
        ),
        ({"param_space": {"trainer": {"report_every_s": _grid(10, -1)}}}, ValueError, r"report_every_s=-1"),
        ({"storage_path": "memory://sweeps"}, ValueError, r"memory:// .*separate processes"),
        ({"storage_path": "s4://bucket/sweeps"}, OSError, r"s4"),
    ],
    ids=[
        "metric-of-a-missing-eval-set",
        "metric-of-another-missing-eval-set",
        "grid-batch-size-0",
        "grid-fractional-epochs",
        "grid-combination",
        "grid-negative-report-interval",
        "storage-in-memory",
        "storage-unknown-protocol",
    ],
)
def test_sweep_refuses_before_ray_starts(tmp_path, no_ray, over, error, fix):  # noqa: F811
    with pytest.raises(error, match=fix):
        _sweep(tmp_path, **over)
    assert not (tmp_path / "s").exists()


def test_sweep_storage_inside_a_file_and_a_bad_base_run_are_refused(tmp_path, no_ray):  # noqa: F811
    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match="which is a file"):
        _sweep(tmp_path, storage_path=str(file / "sweeps"))
    trainer = {k: v for k, v in ray_kwargs().items() if k != "run_name"}
    trainer["model"] = torch.nn.Linear(4, 3)  # an instance: the driver checks run for a sweep's base run too
    with pytest.raises(TypeError, match=r"model=lambda: Linear\("):
        _sweep(tmp_path, trainer=trainer, metric="train/loss", mode="min")


def test_a_sweeps_factories_are_left_to_its_trials(tmp_path, no_ray, caplog):  # noqa: F811
    """Factories that read a trial's config (``config["lr"]`` from param_space) are not called on the base run:
    no refusal and no "could not check" line; the sweep goes on to start Ray."""
    trainer = {k: v for k, v in ray_kwargs().items() if k != "run_name"}
    trainer["optimizers"] = lambda model, config: torch.optim.SGD(model.parameters(), lr=config["lr"])
    with caplog.at_level("WARNING"), pytest.raises(AssertionError, match="Ray was started"):
        _sweep(
            tmp_path, trainer=trainer, param_space={"lr": {"grid_search": [0.1, 0.2]}}, metric="train/loss", mode="min"
        )
    assert not [r for r in caplog.records if "Could not check" in r.getMessage()]


def test_a_sweep_name_too_long_for_a_folder_is_refused(tmp_path, no_ray):  # noqa: F811
    with pytest.raises(ValueError, match=r"name='s{300}' is 300 bytes long"):
        _sweep(tmp_path, name="s" * 300)


def test_a_pbt_sweep_without_checkpoints_is_refused(tmp_path, no_ray):  # noqa: F811
    from raytrain_events.tune import pbt_scheduler

    scheduler = pbt_scheduler("512sp", lr=[0.1, 0.01])
    with pytest.raises(ValueError, match=r"never exploit.*CheckpointConfig\(save_interval=...\)"):
        _sweep(tmp_path, scheduler=scheduler, metric="train/loss", mode="min")


def test_a_pbt_sweep_scoring_an_asynchronously_validated_metric_is_refused(tmp_path, no_ray):  # noqa: F811
    """Its results come after their checkpoint's, with none of their own: PBT would only ever "Skip exploit"."""
    from raytrain_events.ray.checkpointing.validation import AsyncValidation
    from raytrain_events.tune import pbt_scheduler

    trainer = {k: v for k, v in ray_kwargs().items() if k != "run_name"}
    trainer.update(
        datasets={"train": unread_dataset(), "val": unread_dataset()},
        checkpoint=CheckpointConfig(save_interval="1ep"),
        validation=AsyncValidation(datasets=["val"]),
    )
    scheduler = pbt_scheduler("512sp", lr=[0.1, 0.01])
    with pytest.raises(ValueError, match=r"metric='metrics/val/accuracy'.*AsyncValidation.*Fix: evaluate 'val'"):
        _sweep(tmp_path, trainer=trainer, scheduler=scheduler)
    assert not (tmp_path / "s").exists()


# -------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["warmup=1.5dur"], r"t_warmup='1.5dur' is longer than the run"),
        (["warmup=9ep", "epochs=2"], r"warmup=9ep lasts 108 batches.*24"),
        (["report_interval=0ba"], r"report_interval='0ba' must be positive"),
    ],
    ids=["warmup-past-the-run", "warmup-as-long-as-the-run", "report-interval-0"],
)
def test_cli_checks_every_option_before_it_starts_ray(tmp_path, monkeypatch, capsys, no_ray, overrides, fix):  # noqa: F811
    from raytrain_events.cli.main import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", f"storage={tmp_path / 'store'}", "progress_bar=false", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and __import__("re").search(fix, err), err


@pytest.mark.parametrize(
    "words, fix",
    [(["--run-name", "x"], "run_name=x"), (["--epochs=3"], "epochs=3"), (["--max-duration"], "max_duration=")],
)
def test_cli_flags_for_config_keys_name_the_override(capsys, no_ray, words, fix):  # noqa: F811
    from raytrain_events.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", *words])
    assert exit_info.value.code == 2
    assert f"did you mean {fix}" in capsys.readouterr().err


def test_cli_main_stays_the_function_after_its_submodule_is_imported():
    import importlib

    import raytrain_events.cli as cli

    importlib.import_module("raytrain_events.cli.main")
    from raytrain_events.cli import main

    assert callable(main) and main is cli.main and main.__module__ == "raytrain_events.cli.main"


# --------------------------------------------------------------------------- Trainer and the core
def _rows(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _trainer(**over: Any) -> Any:
    from raytrain_events.models import ClassifierModel
    from raytrain_events.trainer.trainer import Trainer

    model = ClassifierModel(torch.nn.Linear(4, 3), num_classes=3)
    kwargs: Dict[str, Any] = dict(
        model=model,
        train_dataloader=DataLoader(_rows(), batch_size=4),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="2ep",
    )
    kwargs.update(over)
    return Trainer(**kwargs)


@pytest.mark.parametrize("warmup", ["1.5dur", "2dur"])
def test_a_warmup_past_the_run_is_refused(warmup):
    from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler, LinearWithWarmupScheduler

    for schedule in (CosineAnnealingWithWarmupScheduler, LinearWithWarmupScheduler):
        with pytest.raises(ValueError, match=rf"t_warmup='{warmup}' is longer than the run.*never reach its peak"):
            schedule(t_warmup=warmup)


def test_a_warmup_as_long_as_the_run_is_announced_once():
    from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="3ep")).fit()
    said = [w for w in caught if "reaches its peak only at the end" in str(w.message)]
    assert len(said) == 1 and "max_duration='2ep'" in str(said[0].message)


def test_a_dataloader_around_a_batch_loader_is_refused():
    from raytrain_events.data.mixture_loader import MixtureLoader

    mixture = Mixture(sources={"a": 16, "b": 16}, weights={"a": 0.5, "b": 0.5})
    loader = MixtureLoader(mixture, {"a": _rows(), "b": _rows()}, batch_size=4)
    with pytest.raises(TypeError, match=r"DataLoader around a MixtureLoader.*train_dataloader=mixtureLoader"):
        _trainer(train_dataloader=DataLoader(loader, batch_size=None))
    with pytest.raises(TypeError, match=r"DataLoader around a DataLoader"):
        _trainer(train_dataloader=DataLoader(DataLoader(_rows(), batch_size=4), batch_size=None))


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"sources": {1: 10, "b": 5}, "weights": {"b": 1}}, r"names that are not strings: \[1\].*'1': \.\.\."),
        ({"sources": {"a": 10, "b": 5}, "weights": {"a": 1, 2.0: 1}}, r"Stage '0dur' has names that are not strings"),
        (
            {
                "sources": {"a": 1000, "b": 1000},
                "weights": {"a": {"choose": 100}, "b": {"choose": 100}},
                "epoch_size": 1000,
            },
            r"selects 200 rows per epoch.*read as proportions of 1000",
        ),
        (
            {"sources": {"a": 100, "b": 100}, "stages": {"0dur": {"a": {"repeat": 1}}, "0.5dur": {"b": {"repeat": 2}}}},
            r"Stage '0.5dur' selects 200 rows.*epoch is 100 samples",
        ),
    ],
    ids=["int-source-name", "float-stage-name", "choose-against-epoch-size", "repeat-against-first-stage"],
)
def test_a_mixture_that_would_mislead_is_refused(kwargs, fix):
    with pytest.raises(MixtureError, match=fix):
        Mixture(**kwargs)


def test_numpy_weights_are_the_numbers_they_print_as():
    numpy_made = Mixture(sources={"a": np.int32(10), "b": 5}, weights={"a": np.float32(0.3), "b": np.float64(0.7)})
    assert numpy_made == Mixture(sources={"a": 10, "b": 5}, weights={"a": 0.3, "b": 0.7})
    assert Mixture.from_dict(numpy_made.to_dict()) == numpy_made
    assert hash(numpy_made) == hash(Mixture(sources={"a": 10, "b": 5}, weights={"a": 0.3, "b": 0.7}))


def test_a_ray_loader_keeps_only_the_columns_asked_for():
    """``columns=[...]``: "only these columns reach the batch" (the loaders' one selection, `pick_columns`)."""
    import pyarrow as pa

    from raytrain_events.data.ray.loader import pick_columns

    table = pa.table({"id": [1, 2], "x": [0.5, 0.25], "label": [0, 1]})
    assert pick_columns(table, ["x", "label"]).column_names == ["x", "label"]
    batch = {"id": np.arange(2), "x": np.zeros(2), "label": np.ones(2)}
    assert sorted(pick_columns(batch, ["label"])) == ["label"]
    with pytest.raises(KeyError, match=r"no column\(s\) \['y'\]"):
        pick_columns(batch, ["y"])


def test_parquet_columns_that_the_files_lack_are_refused(tmp_path):
    from bad_input_helpers import parquet_source

    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    parquet_source(str(tmp_path / "t.parquet"), 8)
    with pytest.raises(ValueError, match=r"columns=\['x', 'label'\]\) names \['label'\].*\['id', 'x'\]"):
        ParquetRowGroups(str(tmp_path / "t.parquet"), columns=["x", "label"])
    assert ParquetRowGroups(str(tmp_path / "t.parquet"), columns=["x"]).schema.names == ["x"]


def test_checkpoint_config_keeps_announcing_by_default_and_ray_workers_do_not(tmp_path, no_ray):  # noqa: F811
    from raytrain_events.ray.driver import RayTrainer

    assert CheckpointConfig().announce_config_change
    spec = RayTrainer(**ray_kwargs(storage_path=str(tmp_path), checkpoint=CheckpointConfig(save_interval="1ep"))).spec
    assert not spec.checkpoints.checkpoint.announce_config_change and not spec.checkpoints.checkpoint.lock_run_dir
