"""RayReporter without Ray: what it reports, that a preemption notice triggers a save, and that a report due while a
save is postponed goes out at its own point, kept from Tune but not from the driver's history and loggers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint import CheckpointConfig, list_checkpoints
from raytrain_events.checkpoint.format import writer as writer_mod  # write_and_commit looks the writers up here
from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
from raytrain_events.core.logger import LoggerDestination
from raytrain_events.models import ClassifierModel
from raytrain_events.ray.reports.aggregate import SAVE_PENDING_KEY
from raytrain_events.ray.reports.history import AggregatingCallback
from raytrain_events.ray.reports.run_loggers import RunLoggers
from raytrain_events.ray.reports.worker_reports import RayReporter


def _trainer(reporter, folder=None, extra=(), duration="1ep", **checkpoint_options):
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    checkpoint = (
        None
        if folder is None
        else CheckpointConfig(save_folder=folder, save_final=False, save_every_n_seconds=None, **checkpoint_options)
    )
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration=duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[reporter, *extra],
        checkpoint=checkpoint,
    )


class _Losses(Callback):
    """Records each batch's loss as the reporter sees it at BATCH_END."""

    def __init__(self) -> None:
        self.losses: list = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))


def test_reports_at_interval_and_at_the_end_with_local_counts():
    sent = []
    losses = _Losses()
    _trainer(RayReporter(interval="3ba", every_s=None, report_fn=lambda r, c: sent.append(r)), extra=[losses]).fit()
    # Each report sums the losses of its own batches (summed in place on the device, reset per report).
    spans = [losses.losses[0:3], losses.losses[3:6], losses.losses[6:8]]
    assert [r["train_loss_sum"] for r in sent] == [pytest.approx(sum(span), rel=1e-6) for span in spans]
    assert [r["train_loss_count"] for r in sent] == [3, 3, 2]
    assert [r["timestamp"]["batch"] for r in sent] == [3, 6, 8]  # the last one is the final report
    assert sum(r["local_samples"] for r in sent) == 64
    assert sent[0]["start"] == {"epoch": 0, "batch": 0, "sample": 0, "token": 0} and sent[1]["start"] is None
    assert sent[-1]["final"] and sent[0]["train_loss_count"] == 3


def test_a_rank_that_does_not_count_data_reports_no_samples_but_its_loss():
    # Tensor parallelism: the group's other ranks trained the same rows; only one rank's counts go into the sums.
    sent = []
    _trainer(RayReporter(interval="3ba", every_s=None, report_fn=lambda r, c: sent.append(r), counts_data=False)).fit()
    assert [r["local_samples"] for r in sent] == [0, 0, 0] and [r["local_tokens"] for r in sent] == [0, 0, 0]
    assert [r["train_loss_count"] for r in sent] == [3, 3, 2]


def test_preemption_notice_saves_a_checkpoint_at_the_next_batch(tmp_path):
    folder = str(tmp_path / "checkpoints")
    notices = iter([False, True, False, False, False])
    reporter = RayReporter(
        interval="2ba",
        every_s=None,
        report_fn=lambda r, c: None,
        check_preemption=True,
        preemption_fn=lambda: next(notices),
    )
    _trainer(reporter, folder).fit()
    # Reports at batches 2 and 4; the notice comes at 4, the save happens at batch 5.
    assert [c.batch for c in list_checkpoints(folder)] == [5]


def test_time_based_reports_are_agreed_through_the_batch_collective():
    sent = []
    _trainer(RayReporter(every_s=0.0, report_fn=lambda r, c: sent.append(r))).fit()
    assert [r["timestamp"]["batch"] for r in sent] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    sent.clear()
    _trainer(RayReporter(every_s=3600.0, report_fn=lambda r, c: sent.append(r))).fit()
    assert [r["final"] for r in sent] == [True]


def test_reporter_needs_an_interval_or_a_period():
    import pytest

    with pytest.raises(ValueError, match="report_interval"):
        RayReporter(interval=None, every_s=None)


class _ReleaseAt(Callback):
    """At the end of batch ``batch``: sets ``event`` (what the held upload waits for), then waits until the
    checkpoint writer is idle (60 s at most), so the postponed save happens at the next batch."""

    def __init__(self, batch: int, event: threading.Event) -> None:
        self.batch, self.event = batch, event

    def batch_end(self, state, logger) -> None:
        if state.timestamp.get_value("ba") == self.batch:
            self.event.set()
            writer = find_checkpointer(state).saved[-1].writer
            deadline = time.monotonic() + 60
            while writer.busy and time.monotonic() < deadline:
                time.sleep(0.01)


class _BatchScore(Callback):
    """Logs a made-up eval score at every batch: the batch number (which point a report's metrics are of)."""

    def batch_end(self, state, logger) -> None:
        logger.log_metrics({"metrics/eval/score": float(state.timestamp.get_value("ba"))})


def _postponed_run(tmp_path, monkeypatch):
    """Saves and reports every 2 batches; the batch-2 save's upload holds until batch 4 has ended, so the save due
    at 4 is postponed to 5. The reports sent, as (report, checkpoint), and the checkpoints' batches by name. The
    60 s bound: a loop that waited for the upload would never end batch 4."""
    released = threading.Event()
    real = writer_mod.write_checkpoint_file

    def held(*args, **kwargs):
        released.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_checkpoint_file", held)
    sent = []
    reporter = RayReporter(interval="2ba", every_s=None, report_fn=lambda r, c: sent.append((r, c)))
    folder = str(tmp_path / "checkpoints")
    extra = [_BatchScore(), _ReleaseAt(4, released)]
    _trainer(reporter, folder, extra=extra, save_interval="2ba").fit()
    return sent, {c.name: c.batch for c in list_checkpoints(folder)}


def test_a_report_due_while_a_save_is_postponed_goes_out_marked_and_the_save_with_its_own(tmp_path, monkeypatch):
    """The report due at 4 goes out at 4 with batch 4's metrics, without a checkpoint and marked ``save_pending``;
    the postponed save goes out at 5 in a report of its own, with that checkpoint (the result Tune gets: PBT acts on
    the first result past a point and copies the checkpoint reported with it). Before, the report at 4 waited and
    merged into the one at 5: batch 4's point never reached the driver (a TensorBoard series lost epoch points)."""
    sent, saved_at = _postponed_run(tmp_path, monkeypatch)
    batches = [r["timestamp"]["batch"] for r, _ in sent]
    assert batches[:3] == [2, 4, 5], batches
    assert [bool(r.get(SAVE_PENDING_KEY)) for r, _ in sent[:3]] == [False, True, False], sent  # later: as loaded
    assert sent[1][1] is None and sent[1][0]["metrics"]["metrics/eval/score"] == 4.0  # its own point's metrics
    for report, checkpoint in (sent[0], sent[2]):  # each save went out with the checkpoint of its own batch
        assert checkpoint is not None and saved_at[checkpoint.name] == report["timestamp"]["batch"], (sent, saved_at)
    assert sum(r["local_samples"] for r, _ in sent) == 64  # every batch counted once, in some report


class _Recorder(LoggerDestination):
    def __init__(self) -> None:
        self.points: list = []

    def log_metrics(self, metrics, step=None) -> None:
        self.points.append((step, metrics.get("metrics/eval/score")))


def test_a_point_reported_while_a_save_is_pending_reaches_the_history_and_loggers_not_tune(tmp_path, monkeypatch):
    """The driver's side of the reports above (the controller's `AggregatingCallback`, the history, `RunLoggers`):
    the pending point at batch 4 is in the history and the loggers at its own step; Tune's queue gets the save's
    report at 5 and not it (a metrics-only result at a perturbation point: "Skip exploit")."""
    sent, _ = _postponed_run(tmp_path, monkeypatch)
    history, tune = [], []
    callback = AggregatingCallback(
        SimpleNamespace(add=SimpleNamespace(remote=history.append)), SimpleNamespace(put=tune.append)
    )
    for report, checkpoint in sent:
        callback.after_report(None, [report], None if checkpoint is None else SimpleNamespace(path=checkpoint.url))
    recorder = _Recorder()
    RunLoggers([recorder], step="batch")(history, history)
    assert [e["time/batch"] for e in history][:3] == [2, 4, 5]
    assert [e["time/batch"] for e in tune][:2] == [2, 5] and not any(e.get(SAVE_PENDING_KEY) for e in tune)
    assert recorder.points[:3] == [(2, 2.0), (4, 4.0), (5, 5.0)]
    assert [e["time/batch"] for e in history if e.get("checkpoint_path")][:2] == [2, 5]


def test_a_timed_report_at_an_epochs_last_batch_waits_for_the_epochs_end_and_its_checkpoint(tmp_path):
    """A report the clock asks for at every batch; saves at each epoch's end. At an epoch's last batch the report goes
    out once, at the epoch's end, with that epoch's checkpoint (not first alone, then again with the checkpoint: PBT
    acts on the first result past a point and copies its checkpoint)."""
    sent = []
    reporter = RayReporter(interval=None, every_s=1e-9, report_fn=lambda r, c: sent.append((r, c)))
    folder = str(tmp_path / "checkpoints")
    _trainer(reporter, folder, duration="2ep", save_interval="1ep", async_save=False).fit()
    at_8 = [c for r, c in sent if r["timestamp"]["batch"] == 8]
    assert len(at_8) == 1 and at_8[0] is not None, [(r["timestamp"]["batch"], c) for r, c in sent]
    assert [r["timestamp"]["batch"] for r, _ in sent][:8] == list(range(1, 9))  # the clock's reports, every batch


def test_a_report_while_a_save_uploads_waits_in_rays_thread_and_one_behind_a_backlog_in_training(tmp_path, monkeypatch):
    """`RayReporter._send`'s mode, through a `Trainer` run (reports every batch, saves every 4, the batch-4 save's
    upload held until batch 6 has ended) with ``ray.train.report`` recorded and Ray's count of reports not yet handed
    to its controller (`reports_waiting`) held at the bound: while the save uploads (5, 6) a report goes out in Ray's
    ASYNC mode (in training it would wait for that upload); with nothing uploading and the bound reached (1-3, 7) a
    plain one (training waits: reports come faster than the controller takes them); a save in its own report."""
    import ray.train

    from raytrain_events.ray.reports import worker_reports

    released = threading.Event()
    real = writer_mod.write_checkpoint_file

    def held(*args, **kwargs):
        if not released.is_set():
            released.wait(60)
        return real(*args, **kwargs)

    sent: list = []
    monkeypatch.setattr(writer_mod, "write_checkpoint_file", held)
    monkeypatch.setattr(worker_reports, "reports_waiting", lambda: worker_reports.REPORTS_WAITING)

    def report(r, checkpoint_upload_mode=ray.train.CheckpointUploadMode.SYNC):
        sent.append((r["timestamp"]["batch"], checkpoint_upload_mode.name))

    def report_with_checkpoint(r, checkpoint, validation):
        sent.append((r["timestamp"]["batch"], "save"))

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(worker_reports, "report_with_checkpoint", report_with_checkpoint)
    reporter = RayReporter(interval="1ba", every_s=None)
    _trainer(reporter, str(tmp_path / "checkpoints"), extra=[_ReleaseAt(6, released)], save_interval="4ba").fit()
    assert sent[:8] == [
        (1, "SYNC"),
        (2, "SYNC"),
        (3, "SYNC"),
        (4, "save"),
        (5, "ASYNC"),
        (6, "ASYNC"),
        (7, "SYNC"),
        (8, "save"),
    ], sent
