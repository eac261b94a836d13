"""A newcomer's first hour (issue 48): what the console and the files say, checked without Ray.

The progress bar says it waits for the workers before the first report; a resumed run's config
changes are announced once, on the driver (the Ray workers log them at INFO, in Ray's files); the
digits job's summary lists every epoch of the run, not only the last fit's; the run report lists
only the checkpoints still in the run directory; the docs build from their own extra.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Dict, List

import torch
from bad_input_helpers import no_ray  # noqa: F401 (a fixture)
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.storage.run_dir import RunDir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_progress_bar_says_it_waits_for_the_workers_until_the_first_report():
    from raytrain_events.core.time import Time, TimeUnit
    from raytrain_events.ray.reports.progress import STARTING, RunProgress

    progress = RunProgress(Time(2, TimeUnit.EPOCH), "run-1")
    try:
        assert progress.bar.postfix == STARTING and "Ray Train workers" in STARTING
        assert str(progress.bar).endswith(f"<?], {STARTING}")  # not "<?] , starting"
        progress([], [{"time/epoch": 1, "time/batch": 3, "time/sample": 48, "train/loss": 0.5}])
        assert "ep 1" in progress.bar.postfix and STARTING not in progress.bar.postfix
    finally:
        progress.close()


def test_a_changed_config_is_announced_once_on_the_driver(tmp_path, caplog):
    from raytrain_events.ray.reports.console import announce_config_change

    run = str(tmp_path / "run")
    announce_config_change(run, {}, {"lr": 0.1})  # a new run: nothing to say
    RunDir(run, {}).save_config({"run_name": "run", "config": {"lr": 0.1, "epochs": 2}})
    with caplog.at_level(logging.WARNING, logger="raytrain_events.ray.reports.console"):
        announce_config_change(run, {}, {"lr": 0.1, "epochs": 2})  # unchanged: nothing either
        announce_config_change(run, {}, {"lr": 0.05, "epochs": 2})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "- lr: 0.1\n+ lr: 0.05" in said[0] and "epochs" not in said[0]
    assert "\x1b[" not in said[0]  # plain text: no colour codes to break the progress bar


def test_a_ray_worker_logs_the_config_change_at_info_only(caplog):
    from raytrain_events.checkpoint.run.loading import _warn_config_changed

    host = SimpleNamespace(state=SimpleNamespace(rank=0), config={"lr": 0.05})
    loaded = SimpleNamespace(info=SimpleNamespace(metadata={"config": {"lr": 0.1}}, url="/r/ckpt-1"))
    with caplog.at_level(logging.INFO, logger="raytrain_events.checkpoint.run.loading"):
        _warn_config_changed(host, loaded, announce=False)
        _warn_config_changed(host, loaded, announce=True)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]


def _epoch_entry(epoch: int, accuracy: float) -> Dict[str, Any]:
    return {
        "time/epoch": epoch,
        "time/batch": 12 * epoch,
        "time/sample": 96 * epoch,
        "train/loss": 1.0 / epoch,
        "metrics/eval/accuracy": accuracy,
    }


def test_a_resumed_runs_summary_lists_every_epoch(tmp_path):
    from raytrain_events.cli.summary import format_summary, run_summary
    from raytrain_events.core.time import Timestamp

    run = str(tmp_path / "run")
    earlier = [_epoch_entry(1, 0.5), _epoch_entry(2, 0.6)]
    this_fit = [_epoch_entry(3, 0.7)]
    RunDir(run, {}).append_history(earlier)
    RunDir(run, {}).append_history(this_fit)  # what RayTrainer.fit appends at its end
    result = SimpleNamespace(
        timestamp=Timestamp(epoch=3, batch=36, sample=288),
        metrics=this_fit[-1],
        history=this_fit,
        checkpoints=[],
        run_url=run,
    )
    summary = run_summary(result, run_name="run", config={}, seconds=1.0, checkpoint_folder=None)
    assert [e["epoch"] for e in summary["eval_history"]] == [1, 2, 3]
    assert "epoch   1" in format_summary(summary) and "epoch   3" in format_summary(summary)


def test_the_report_lists_only_the_checkpoints_keep_left(tmp_path):
    from raytrain_events.checkpoint import list_checkpoints
    from raytrain_events.models import ClassifierModel
    from raytrain_events.report import write_report
    from raytrain_events.trainer.trainer import Trainer

    run = tmp_path / "run"
    model = ClassifierModel(torch.nn.Linear(4, 3), num_classes=3)
    rows = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    Trainer(
        model=model,
        train_dataloader=DataLoader(rows, batch_size=4),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="4ba",
        checkpoint=CheckpointConfig(save_folder=str(run / "checkpoints"), save_interval="1ba", keep=1),
    ).fit()
    kept = [c.name for c in list_checkpoints(str(run / "checkpoints"))]
    assert len(kept) == 1
    saved: List[Dict[str, Any]] = [
        {**_epoch_entry(1, 0.5), "time/batch": b, "checkpoint_path": str(run / "checkpoints" / name)}
        for b, name in ((1, "ckpt-000000000001-aaaaaa"), (2, "ckpt-000000000002-bbbbbb"), (4, kept[0]))
    ]
    RunDir(str(run), {}).append_history(saved)
    write_report(str(run))
    html = (run / "report.html").read_text()
    assert kept[0] in html and "ckpt-000000000001-aaaaaa" not in html and "ckpt-000000000002-bbbbbb" not in html
    assert "2 older one(s) were deleted (keep)" in html


def test_the_docs_have_their_own_extra_and_the_readme_uses_it():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0] for req in extras["docs"]}
    assert names == {"mkdocs", "mkdocs-material", "mkdocstrings-python"}
    assert not {"pytest", "moto[server]", "torchft", "transformers", "mypy"} & names
    readme = open(os.path.join(ROOT, "README.md")).read()
    # the variable: Material's end-of-life notice stays off a reader's terminal (tests/test_docs.py builds with it)
    assert '-e ".[docs]" && NO_MKDOCS_2_WARNING=1 mkdocs serve' in readme and "digits-<date>-<time>-<6 hex>" in readme


def test_the_digits_job_names_its_runs_as_the_readme_says(tmp_path, monkeypatch, no_ray):  # noqa: F811
    """The CLI's default job, up to Ray's start (refused by `no_ray`): its run folder is digits-<date>-<time>-<6 hex>."""
    import re

    import pytest

    from raytrain_events.cli.main import main

    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        with pytest.raises(AssertionError, match="Ray was started"):  # every check passed first
            main(["train", f"storage={tmp_path / 'store'}", "progress_bar=false"])
    names = sorted(os.listdir(tmp_path / "store"))
    assert len(names) == 2 and all(re.fullmatch(r"digits-\d{8}-\d{6}-[0-9a-f]{6}", n) for n in names), names


def test_a_ray_warning_it_calls_safe_to_ignore_stays_off_the_console_line_by_line():
    """Under CPU load Ray forwards the controller's "Failed to send resource request" traceback a line at a time."""
    from raytrain_events.ray.reports.console import filter_batch

    block = [
        "Failed to send resource request for train-64988db1. If this only happens transiently during network "
        "partition or CPU being overloaded, it's safe to ignore this error.",
        "Traceback (most recent call last):",
        '  File "/site-packages/ray/train/v2/_internal/autoscaling_coordinator_client.py", line 58, in send',
        "    ray.get(",
        "    ^^^^^^^^",
        "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
    ]
    controller = {"actor_name": "TrainController", "pid": 7}
    assert [filter_batch({**controller, "lines": [line]}) for line in block] == [None] * len(block)
    after = filter_batch({**controller, "lines": ["the user's own line"]})
    assert after is not None and after["lines"] == ["the user's own line"]
    listing = {"actor_name": "ListFiles", "pid": 9}
    race = [
        "Exception in thread Thread-3 (completion-signaler):",
        "Traceback (most recent call last):",
        "    self.run()",
        "InterruptedError",
    ]
    assert [filter_batch({**listing, "lines": [line]}) for line in race] == [None] * len(race)
    worker = {"actor_name": "RayTrainWorker", "pid": 8, "lines": ["Traceback (most recent call last):", "  x"]}
    assert filter_batch(worker)["lines"] == worker["lines"]  # a user's traceback still shows


def test_a_postponed_checkpoint_save_warns_only_when_storage_misses_an_interval_and_from_rank_0(caplog):
    """The digits example on a loaded machine printed the postponed-save warning once per worker (one copy
    after the summary) for a save 1 batch late: a postponed save is said at INFO; a save that comes due
    while the previous due one still waits (storage slower than the interval) warns once, from rank 0."""
    from raytrain_events.checkpoint.run.checkpointer import Checkpointer

    def run(rank: int, dues: List[Any]) -> List[int]:
        saved: List[int] = []
        host = SimpleNamespace(_deferred=False, _said_postponed=0)
        host.save = lambda: saved.append(batch)
        for batch, (due, busy) in enumerate(dues, 1):
            if due or host._deferred:  # as batch_checkpoint calls it
                state = SimpleNamespace(
                    rank=rank, agreed=lambda flag, b=busy: b, timestamp=SimpleNamespace(get_value=lambda u, n=batch: n)
                )
                Checkpointer._save_unless_busy(host, state, due)  # type: ignore[arg-type]
        return saved

    late = [(True, True), (False, True), (False, False)]  # due at 1, taken at 3: a few batches late
    missed = [(True, True), (False, True), (True, True), (False, False)]  # due at 3 while 1's save still waits
    with caplog.at_level(logging.INFO, logger="raytrain_events.checkpoint.run.checkpointer"):
        assert run(1, late + missed) == [3, 7] and not caplog.records  # another rank: silent
        assert run(0, late) == [3]
        assert run(0, late + missed + late + missed) == [3, 7, 10, 14]
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.INFO, logging.INFO, logging.WARNING]  # then once per run
    assert "due at batch 1 " in said[0][1] and "further apart" not in said[0][1]
    assert "due at batch 6 " in said[2][1] and "further apart" in said[2][1]


def test_a_ray_workers_info_lines_stay_in_its_files(tmp_path):
    """Ray Train's worker logging sends the root logger's INFO to the console (forwarded to the driver): the
    digits example showed the checkpointer's INFO line on the terminal. Off the console, kept in the file."""
    import io

    from raytrain_events.ray.reports.console import quiet_worker_console

    root, stream = logging.getLogger(), io.StringIO()
    console, file = logging.StreamHandler(stream), logging.FileHandler(tmp_path / "app.log")
    saved = root.level
    root.addHandler(console), root.addHandler(file), root.setLevel(logging.INFO)
    try:
        quiet_worker_console(verbose=False)
        quiet_worker_console(verbose=False)  # once per handler, however often called
        logging.getLogger("raytrain_events.checkpoint.run.checkpointer").info("postponed")
        logging.getLogger("raytrain_events.checkpoint.run.checkpointer").warning("falls behind")
        logging.getLogger("user_code").info("the user's line")
        assert len(console.filters) == 1 and file.filters == []
    finally:
        root.removeHandler(console), root.removeHandler(file), root.setLevel(saved)
        file.close()
    assert stream.getvalue().splitlines() == ["falls behind", "the user's line"]
    assert (tmp_path / "app.log").read_text().splitlines() == ["postponed", "falls behind", "the user's line"]
