"""`RunSpec` is the one definition of a Ray run's options (no Ray started here)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.time import Time
from raytrain_events.ray.driver import RayTrainer
from raytrain_events.ray.spec import RunSpec, option_names


def make_model():
    return None


def _spec(**over):
    base = dict(model=make_model, optimizers=lambda m: None, datasets={"train": object()}, max_duration="1ep")
    base.update(over)
    return RunSpec(**base)


def test_keyword_arguments_are_the_spec_fields():
    """RayTrainer(**kwargs) builds the RunSpec: every field is accepted, nothing else is."""
    trainer = RayTrainer(
        model=make_model,
        optimizers=lambda m: None,
        datasets={"train": object(), "eval": object()},
        max_duration=3,
        batch_size=8,
        num_workers=2,
        seed=None,
    )
    assert trainer.spec == dataclasses.replace(trainer.spec)  # a plain dataclass
    assert (
        trainer.spec.max_duration == "3ep" and trainer.spec.data.batch_size == 8 and trainer.spec.scaling.workers == 2
    )
    # Parsed and checked once, here: the driver's progress bar and the workers receive this Time.
    assert isinstance(trainer.spec.max_duration, Time) and trainer.spec.describe()["max_duration"] == "3ep"
    assert trainer.spec.for_workers(datasets={"train": None}).max_duration is trainer.spec.max_duration
    assert trainer.spec.data.eval_names == ["eval"]
    assert list(inspect.signature(RayTrainer).parameters) == ["spec", "options"]  # no restated options
    with pytest.raises(TypeError, match="'learning_rate'.*not a RayTrainer argument.*batch_size"):
        RayTrainer(**dataclasses.asdict(_spec()), learning_rate=0.1)
    with pytest.raises(TypeError, match="needs optimizers, datasets"):
        RayTrainer(model=make_model, max_duration="1ep")


def test_a_spec_and_keywords_combine():
    spec = _spec(batch_size=16)
    trainer = RayTrainer(spec, batch_size=4, run_name="r")
    assert trainer.spec.data.batch_size == 4 and trainer.run_name == "r"
    assert spec.data.batch_size == 16  # the given spec is untouched
    assert RayTrainer(spec).spec is spec
    with pytest.raises(TypeError, match="RunSpec or keyword options"):
        RayTrainer({"model": make_model})


def test_replace_is_validated_like_a_new_spec():
    spec = _spec()
    with pytest.raises(ValueError, match="batch_size=0"):
        spec.replace(batch_size=0)
    with pytest.raises(ValueError, match="give it in 'ep'"):
        spec.replace(max_duration="0.5dur")
    with pytest.raises(TypeError, match="'nope'.*not a RayTrainer argument"):
        spec.replace(nope=1)
    with pytest.raises(ValueError, match="either scaling_config or num_workers"):
        spec.replace(num_workers=2, scaling_config={"num_workers": 2})
    assert spec.replace(scaling_config={"num_workers": 3}).scaling.workers == 3


def test_describe_covers_every_option_as_plain_data():
    spec = _spec(
        algorithms=["label_smoothing", {"name": "mixup", "alpha": 0.2}],
        checkpoint=CheckpointConfig(save_interval="2ep", storage_options={"key": "secret"}),
        config={"lr": 0.1},
        run_name="described",
    )
    described = spec.describe()
    assert list(described) == option_names()  # derived from the fields: a new option shows up by itself
    assert described["model"] == f"{__name__}.make_model"  # functions by name: no memory addresses
    assert described["datasets"] == {"train": "object"}
    assert described["algorithms"] == ["label_smoothing", {"name": "mixup", "alpha": 0.2}]
    assert described["checkpoint"]["save_interval"] == "2ep" and "storage_options" not in described["checkpoint"]
    assert described["num_workers"] == 1 and described["run_name"] == "described"
    assert described["config"] == {"lr": 0.1}
    assert RayTrainer(spec).describe() == described


def test_workers_get_no_driver_only_options():
    spec = _spec(
        datasets={"train": object(), "eval": object()},
        ray_callbacks=[object()],
        progress_bar=True,
        driver_loggers=[object()],
    )
    shipped = spec.for_workers(steps_per_epoch=5)
    assert shipped.data.datasets == {"train": None, "eval": None} and shipped.data.eval_names == ["eval"]
    assert (
        shipped.reports.ray_callbacks == ()
        and shipped.reports.progress_bar is None
        and shipped.data.steps_per_epoch == 5
    )
    assert shipped.reports.driver_loggers == []  # driver_loggers run on the driver, fed from the aggregated history
    assert shipped.storage.run_url == spec.storage.run_url


def test_checkpoint_config_is_prepared_for_the_run_dir():
    spec = _spec(checkpoint=CheckpointConfig(save_interval="1ep"))
    assert spec.checkpoints.checkpoint.lock_run_dir is False
    with pytest.raises(ValueError, match="save_folder cannot be set"):
        _spec(checkpoint=CheckpointConfig(save_folder="/tmp/x"))


def test_a_datasets_factory_is_resolved_by_name_for_the_workers():
    spec = _spec(datasets=lambda config: {"train": config["n"], "holdout": 2}, config={"n": 1})
    datasets = spec.build_datasets()
    assert datasets == {"train": 1, "holdout": 2}
    assert spec.for_workers(datasets, steps_per_epoch=3).data.eval_names == ["holdout"]
    with pytest.raises(ValueError, match="datasets factory returned"):
        _spec(datasets=lambda: {"eval": 1}).build_datasets()


def test_result_names_the_newest_checkpoint_latest():
    from raytrain_events.core.time import Timestamp
    from raytrain_events.ray.result import RayResult

    result = RayResult(timestamp=Timestamp(), metrics={}, history=[], checkpoints=["ep1", "ep2"])
    assert result.latest_checkpoint == "ep2"
    assert RayResult(timestamp=Timestamp(), metrics={}, history=[]).latest_checkpoint is None


def test_grad_accum_auto_and_eval_options_are_checked_on_the_driver():
    assert _spec(grad_accum="auto").grad_accum == "auto"
    with pytest.raises(ValueError, match="grad_accum='max'.*or 'auto'"):
        _spec(grad_accum="max")
    spec = _spec(eval_options={"val": {"eval_interval": "10ba", "subset_num_batches": 2}})
    assert spec.data.eval_options["val"]["subset_num_batches"] == 2
    with pytest.raises(ValueError, match=r"eval_options\['val'\] has unknown keys \['subset'\]"):
        _spec(eval_options={"val": {"subset": 2}})


def test_hang_timeout_is_positive_seconds_or_none_and_sets_the_process_group_timeout():
    from raytrain_events.ray.guards.watchdog import process_group_timeout_s

    assert _spec().failures.hang_timeout is None and _spec(hang_timeout=30).failures.hang_timeout == 30
    for bad in (0, -5, "5m", True):
        with pytest.raises(ValueError, match=f"hang_timeout={bad!r} must be a positive number of seconds"):
            _spec(hang_timeout=bad)
    assert process_group_timeout_s(_spec(hang_timeout=30).failures.hang_timeout) > 30


def test_datasets_are_checked_once_built_naming_the_fix(tmp_path):
    """The train set is a Ray Dataset or a seekable source (`ParquetRowGroups`); eval sets are Ray Datasets."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.data_config import cheap_row_count
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    paths = [str(tmp_path / f"{i}.parquet") for i in range(2)]
    for path in paths:
        pq.write_table(pa.table({"id": list(range(30))}), path, row_group_size=8)
    source = ParquetRowGroups(paths)
    assert cheap_row_count(source) == 60 and len(source.units) == 8  # from the footers
    RunSpec.check_datasets({"train": source})
    with pytest.raises(TypeError, match=r"datasets\['train'\] is a list.*ParquetRowGroups\(paths\)"):
        RunSpec.check_datasets({"train": paths})
    with pytest.raises(TypeError, match=r"datasets\['val'\] is a ParquetRowGroups, a train-only source"):
        RunSpec.check_datasets({"train": source, "val": source})
    with pytest.raises(TypeError, match=r"datasets\['val'\] is a dict; an eval set must be a ray.data.Dataset"):
        RunSpec.check_datasets({"train": source, "val": {"x": 1}})
    # A file, a folder (its .parquet files in sorted order) or a glob: one path is enough.
    assert ParquetRowGroups(paths[0]).paths == paths[:1]
    assert ParquetRowGroups(str(tmp_path)).paths == ParquetRowGroups(str(tmp_path / "*.parquet")).paths == paths
    with pytest.raises(FileNotFoundError, match=r"found no Parquet files at .*nowhere.*Check the path"):
        ParquetRowGroups(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"read_bytes=0.*>= 1"):
        ParquetRowGroups(paths, read_bytes=0)


def test_async_validation_is_checked_before_ray_starts_naming_the_fix():
    """``validation``: in-loop by default; 'async', a dict (config files, Tune) or AsyncValidation; bad ones refused."""
    from raytrain_events.ray.checkpointing.validation import AsyncValidation

    datasets = {"train": object(), "val": object(), "eval": object()}
    ckpt = CheckpointConfig(save_interval="4ba")
    assert _spec().checkpoints.validation is None  # in-loop evaluation stays the default
    assert _spec(datasets=datasets, checkpoint=ckpt, validation="async").checkpoints.validation == AsyncValidation()
    spec = _spec(datasets=datasets, checkpoint=ckpt, validation={"datasets": ["val"], "resources": {"CPU": 2}})
    assert spec.checkpoints.validation.datasets == ("val",)
    assert spec.checkpoints.validation.ray_remote_kwargs() == {"num_cpus": 2, "max_retries": 0}
    assert spec.describe()["validation"]["datasets"] == ["val"]  # config.yaml: plain data
    with pytest.raises(ValueError, match=r"saves none: pass checkpoint=CheckpointConfig\(save_interval"):
        _spec(datasets=datasets, validation="async")
    with pytest.raises(
        ValueError, match=r"names \['test'\], which are not eval sets of this run \(\['eval', 'val'\]\)"
    ):
        _spec(datasets=datasets, checkpoint=ckpt, validation=AsyncValidation(datasets=["test"]))
    with pytest.raises(ValueError, match="no eval set to evaluate: add one to datasets"):
        _spec(checkpoint=ckpt, validation="async")
    with pytest.raises(ValueError, match="use None .in-loop evaluation, the default., 'async'"):
        _spec(datasets=datasets, checkpoint=ckpt, validation="sometimes")
    with pytest.raises(ValueError, match=r"unknown keys \['gpus'\]: use datasets, every, resources"):
        _spec(datasets=datasets, checkpoint=ckpt, validation={"gpus": 1})
    with pytest.raises(ValueError, match="every=0. must be a positive integer"):
        AsyncValidation(every=0)
    with pytest.raises(ValueError, match="resources=.* e.g. {'CPU': 1}"):
        AsyncValidation(resources={"CPU": -1})
    with pytest.raises(TypeError, match="list of eval set names"):
        AsyncValidation(datasets="val")
    with pytest.raises(ValueError, match="timeout_s=0. must be a positive number"):
        AsyncValidation(timeout_s=0)
    with pytest.raises(ValueError, match="saves none"):  # a Tune override is checked like a new spec
        _spec(datasets=datasets, checkpoint=ckpt).replace(validation="async", checkpoint=None)


def test_unfinished_validations_are_recorded_as_failed():
    """A checkpoint whose validation was asked for (its entry marked where that was decided) and left no entry (Ray
    cancelled it at timeout_s) gets a failed entry; unmarked checkpoints are not counted again here."""
    from raytrain_events.ray.checkpointing.validation import (
        ASKED_KEY,
        AsyncValidation,
        training_entries,
        unfinished_validations,
    )

    entries = [
        {"time/batch": 4, "time/sample": 128, "attempt": 1, "checkpoint_path": "/r/checkpoints/ckpt-4", ASKED_KEY: 1},
        {"time/batch": 8, "time/sample": 256, "attempt": 1, "checkpoint_path": "/r/checkpoints/ckpt-8", ASKED_KEY: 1},
        {"time/batch": 4, "time/sample": 128, "validation": "async", "validated_checkpoint": "ckpt-4"},
        {"time/batch": 12, "time/sample": 384, "attempt": 2, "checkpoint_path": "/r/checkpoints/ckpt-12"},
        {
            "time/batch": 16,
            "time/sample": 512,
            "attempt": 2,
            "checkpoint_path": "/r/checkpoints/ckpt-16/",
            ASKED_KEY: 1,
        },
    ]
    missing = unfinished_validations(entries, AsyncValidation(timeout_s=5))
    assert [(e["validated_checkpoint"], e["time/sample"], e["validation"]) for e in missing] == [
        ("ckpt-8", 256, "failed"),
        ("ckpt-16", 512, "failed"),  # ckpt-12 was not chosen (every=2 in its group): no entry expected
    ]
    assert "timed out (timeout_s=5)" in missing[0]["validation_error"]
    assert len(training_entries(entries)) == 4


def test_the_reporter_marks_the_checkpoints_it_asks_ray_train_to_validate(monkeypatch):
    """Rank 0's `RayReporter` counts its group's checkpoints and asks for every ``every``-th one's validation; its
    report, and the driver's aggregated entry, carry that choice (``ASKED_KEY``), which `unfinished_validations` reads
    instead of counting again."""
    from raytrain_events.ray.checkpointing.validation import ASKED_KEY, AsyncValidation
    from raytrain_events.ray.reports import worker_reports
    from raytrain_events.ray.reports.aggregate import ReportAggregator

    sent = []
    monkeypatch.setattr(worker_reports, "report_with_checkpoint", lambda r, c, validation: sent.append((r, validation)))
    reporter = worker_reports.RayReporter(validation=AsyncValidation(every=2))
    counters = {"batch": 0, "epoch": 0, "sample": 0, "token": 0}
    report = {
        "start": None,
        "local_samples": 0,
        "local_tokens": 0,
        "metrics": {},
        "final": False,
        "timestamp": counters,
    }
    for _ in range(4):
        reporter._send(dict(report), checkpoint=object())
    assert [asked for _, asked in sent] == [False, True, False, True]
    assert [bool(r.get(ASKED_KEY)) for r, _ in sent] == [False, True, False, True]
    aggregator = ReportAggregator()
    entries = [aggregator.add([r, dict(report)], f"/c/ckpt-{i}") for i, (r, _) in enumerate(sent)]
    assert [e.get(ASKED_KEY, False) for e in entries] == [False, True, False, True]


def test_a_mixture_is_one_plain_option_whose_sources_are_not_eval_sets():
    from raytrain_events.core.mixture import Mixture, MixtureError

    mixture = Mixture(
        sources={"web": 80, "code": 20}, stages={"0dur": {"web": 0.8, "code": 0.2}, "0.5dur": {"code": 1}}
    )
    spec = _spec(datasets={"web": object(), "code": object(), "val": object()}, mixture=mixture)
    assert spec.data.mixture == mixture.to_dict() and Mixture.from_dict(spec.data.mixture) == mixture  # plain data
    assert spec.describe()["mixture"] == mixture.to_dict() and spec.data.eval_names == ["val"]
    assert spec.replace(mixture=mixture.to_dict()).data.mixture == spec.data.mixture  # a Tune override: its dict
    with pytest.raises(MixtureError, match="summing to 0"):
        spec.replace(mixture={"sources": {"web": 80}, "weights": {"web": 0}})
    with pytest.raises(ValueError, match="no 'train' entry"):
        _spec(datasets={"web": object()})
    shipped = spec.for_workers({"train": object(), "val": object()})
    assert shipped.data.mixture is None and shipped.data.eval_names == ["val"]  # the shard carries the plan's arguments
