"""The driver's terminal for a Ray run, without Ray: which forwarded lines are noise, the progress text,
and the loggers fed from the run history (one call per report round, global step, trial names)."""

from __future__ import annotations

import json

import pytest

from raytrain_events.loggers import FileLogger, TensorBoardLogger
from raytrain_events.ray.reports.console import filter_batch, is_noise
from raytrain_events.ray.reports.progress import describe_entry
from raytrain_events.ray.reports.run_loggers import RunLoggers, metrics_of, name_destination


def _batch(lines, actor=None, pid=123):
    return {"lines": lines, "pid": pid, "actor_name": actor, "task_name": None, "is_err": True}


def test_known_ray_noise_is_dropped_and_everything_else_kept():
    noisy = _batch(
        [
            "Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.",
        ],
        actor="PlacementGroupCleaner",
    )
    assert filter_batch(noisy) is None
    mixed = _batch(
        [
            "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`.",
            "✔️  Dataset dataset_1_0 execution finished in 6.02 seconds",
            "epoch 3: my own print",
        ],
        actor="RayTrainWorker",
    )
    assert filter_batch(mixed)["lines"] == ["epoch 3: my own print"]
    raylet = _batch(["WARNING: 10 PYTHON worker processes have been started on node: abc"], pid="raylet")
    assert filter_batch(raylet) is None
    gcs = _batch(
        [
            "[2026-11-27 21:00:00,000 E 1 1] gcs_actor_scheduler.cc:538: Failed to kill actor NIL_ID, return status: "
            "Invalid: KillActor RPC failed"
        ],
        pid="gcs_server",
    )
    assert filter_batch(gcs) is None
    report = _batch(
        ["Reporting training result 3: TrainingReport(checkpoint=None, metrics={})"], actor="RayTrainWorker"
    )
    assert filter_batch(report) is None
    # The same text from the user's own actor is not Ray's: only the listed sources are filtered.
    assert not is_noise("MyActor", "Failed to query Ray Train Controller actor state")
    # A worker's error always shows.
    error = _batch(["Traceback (most recent call last):", "ValueError: bad batch"], actor="RayTrainWorker")
    assert filter_batch(error)["lines"] == error["lines"]


def test_a_known_internal_traceback_is_dropped_as_a_block():
    block = _batch(
        [
            "Exception in thread PlacementGroupCleanerMonitor:",
            "Traceback (most recent call last):",
            "ConnectionError: Found multiple active Ray instances: {'127.0.0.1:1', '127.0.0.1:2'}.",
        ],
        actor="PlacementGroupCleaner",
    )
    assert filter_batch(block) is None


def test_progress_text_has_global_counters_loss_eval_metric_and_throughput():
    entries = [
        {"time/epoch": 1, "time/batch": 12, "time/sample": 1500, "attempt": 1, "wall_time": 10.0, "train/loss": 1.2},
        {
            "time/epoch": 2,
            "time/batch": 24,
            "time/sample": 3000,
            "attempt": 1,
            "wall_time": 13.0,
            "train/loss": 0.5,
            "metrics/eval/accuracy": 0.9123,
            "metrics/eval/cross_entropy": 0.3,
        },
    ]
    assert (
        describe_entry(entries[-1], entries) == "ep 2 | ba 24 | sp 3,000 | loss 0.5 | eval/accuracy 0.9123 | 500 sp/s"
    )
    final = dict(entries[-1], wall_time=20.0)  # the end-of-run report: no new batches, no loss of its own
    del final["train/loss"]
    assert describe_entry(final, entries + [final]) == describe_entry(entries[-1], entries)


def test_run_loggers_log_each_round_once_at_the_global_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    loggers = RunLoggers([FileLogger(str(path))], step="sample", hyperparameters={"lr": 0.1})
    entry = {
        "time/epoch": 1,
        "time/batch": 12,
        "time/sample": 1500,
        "train/loss": 0.7,
        "metrics/eval/accuracy": 0.8,
        "attempt": 1,
        "wall_time": 5.0,
        "world_size": 2,
        "final": False,
        "checkpoint_path": "/x",
    }
    loggers([entry], [entry])
    second = dict(entry, **{"time/sample": 3000, "train/loss": 0.4})
    loggers([second], [entry, second])
    final = dict(second, final=True)  # the end-of-run report: same step, nothing new
    loggers([final], [entry, second, final])
    loggers.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"hyperparameters": {"lr": 0.1}}
    assert lines[1:] == [
        {"step": 1500, "train/loss": 0.7, "metrics/eval/accuracy": 0.8},
        {"step": 3000, "train/loss": 0.4, "metrics/eval/accuracy": 0.8},
    ]
    assert metrics_of({"time/batch": 3, "final": True, "x": "text"}) == {}
    with pytest.raises(ValueError, match="log_step='minutes'"):
        RunLoggers([], step="minutes")


def test_trial_names_reach_each_destination(tmp_path):
    tb = name_destination(TensorBoardLogger(str(tmp_path / "tb")), "trial_1-mixup")
    assert tb.log_dir == str(tmp_path / "tb" / "trial_1-mixup")
    file = name_destination(FileLogger(str(tmp_path / "m.jsonl")), "trial_1-mixup")
    assert file.path == str(tmp_path / "m-trial_1-mixup.jsonl")
