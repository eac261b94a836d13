"""SpeedMonitor, LRMonitor, MemoryMonitor, NaNMonitor, ProgressBar and ConsoleLogger."""

from __future__ import annotations

import io

import pytest
import torch
from library_helpers import MemoryDestination, Record, TinyLM, classifier, loader, token_batches, trainer

from raytrain_events import Callback, DataSpec, Event
from raytrain_events.callbacks import (
    ConsoleLogger,
    LRMonitor,
    MemoryMonitor,
    NaNMonitor,
    NonFiniteLossError,
    ProgressBar,
    SpeedMonitor,
)
from raytrain_events.schedulers import LinearScheduler


class FakeClock(Callback):
    """Advances a fake clock 0.5 s per batch and 10 s per eval batch (listed before SpeedMonitor)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def batch_start(self, state, logger) -> None:
        self.now += 0.5

    def eval_batch_start(self, state, logger) -> None:
        self.now += 10.0


def test_speed_monitor_rates_from_the_timestamp():
    clock = FakeClock()
    monitor = SpeedMonitor(window_size=4, flops_per_sample=100.0, peak_flops=1e4, clock=clock)
    dest = MemoryDestination()
    spec = DataSpec(
        token_batches(12, batch_size=4, seq_len=8), get_num_tokens_in_batch=lambda b: b["input_ids"].numel()
    )
    trainer(
        TinyLM(),
        train_dataloader=spec,
        max_duration="12ba",
        callbacks=[clock, monitor],
        loggers=[dest],
        eval_dataloader=token_batches(2, batch_size=4, seq_len=8),
        eval_interval="6ba",
    ).fit()
    rates = dest.series("throughput/batches_per_sec")
    assert [step for step, _ in rates] == list(range(5, 13))  # once window_size + 1 batch ends are known
    # eval time (20 s of fake clock at step 6) is excluded: every window is exactly 0.5 s per batch
    assert all(v == pytest.approx(2.0) for _, v in rates)
    last = monitor.last
    assert last["throughput/samples_per_sec"] == pytest.approx(2.0 * 4)
    assert last["throughput/tokens_per_sec"] == pytest.approx(2.0 * 32)
    assert last["throughput/device/samples_per_sec"] == last["throughput/samples_per_sec"]  # world_size 1
    assert last["throughput/device/flops_per_sec"] == pytest.approx(8 * 100.0)
    assert last["throughput/device/mfu"] == pytest.approx(800.0 / 1e4)
    assert dest.series("wall_clock/eval")[-1][1] == pytest.approx(40.0)  # evals at 6ba and 12ba, 2 batches each
    assert dest.series("wall_clock/train")[-1][1] == pytest.approx(6.0)


def test_speed_monitor_with_real_clock_is_consistent():
    monitor = SpeedMonitor(window_size=3)
    trainer(train_dataloader=loader(n=48, batch_size=8), max_duration="6ba", callbacks=[monitor]).fit()
    last = monitor.last
    assert last["throughput/batches_per_sec"] > 0
    assert last["throughput/samples_per_sec"] == pytest.approx(8 * last["throughput/batches_per_sec"])
    assert "throughput/tokens_per_sec" not in last  # data without a token counter


def test_lr_monitor_logs_each_group():
    model = classifier(hidden=4)
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=1.0)
    dest = MemoryDestination()
    trainer(
        model,
        optimizer=opt,
        max_duration="4ba",
        schedulers=LinearScheduler(t_max="1dur"),
        callbacks=[LRMonitor()],
        loggers=[dest],
    ).fit()
    # logged at BATCH_END after the scheduler step: the LR of the next batch, 1 - k/4
    assert dest.series("lr-SGD/group0") == [(k, pytest.approx(1 - k / 4)) for k in range(1, 5)]
    assert dest.series("lr-SGD/group1") == [(k, pytest.approx(0.5 * (1 - k / 4))) for k in range(1, 5)]


def test_memory_monitor_logs_host_memory_at_interval():
    dest = MemoryDestination()
    monitor = MemoryMonitor(interval=2)
    trainer(max_duration="4ba", callbacks=[monitor], loggers=[dest]).fit()
    series = dest.series("memory/host_rss_gb")
    assert [step for step, _ in series] == [2, 4]
    assert all(0 < v < 1000 for _, v in series)
    assert monitor.last["memory/host_peak_rss_gb"] >= monitor.last["memory/host_rss_gb"] * 0.5


def _nan_loader(nan_batch: int, n_batches: int = 6):
    x = torch.randn(n_batches * 4, 4)
    x[nan_batch * 4] = float("nan")
    return [(x[i * 4 : (i + 1) * 4], torch.zeros(4, dtype=torch.long)) for i in range(n_batches)]


def test_nan_monitor_raises_before_the_weights_are_corrupted():
    model = classifier()
    with pytest.raises(NonFiniteLossError, match="batch 3"):
        trainer(model, train_dataloader=_nan_loader(nan_batch=2), max_duration="6ba", callbacks=[NaNMonitor()]).fit()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_monitor_interval_checks_every_nth_batch():
    steps = Record({Event.BATCH_END: lambda s: s.step})
    with pytest.raises(NonFiniteLossError, match="batch 4"):  # NaN in batch 3, first check at batch 4
        trainer(
            train_dataloader=_nan_loader(nan_batch=2), max_duration="6ba", callbacks=[NaNMonitor(interval=2), steps]
        ).fit()
    assert steps.values[Event.BATCH_END] == [1, 2, 3]


def test_progress_bar_on_rank_zero_shows_epoch_and_loss():
    stream = io.StringIO()
    trainer(max_duration="2ep", callbacks=[ProgressBar(refresh_interval=2, stream=stream)]).fit()
    text = stream.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text and "loss=" in text and "4/4" in text

    class Rank1:
        rank = 1

    silent = ProgressBar(stream=io.StringIO())
    silent.fit_start(Rank1(), None)
    silent.epoch_start(Rank1(), None)
    assert silent.stream.getvalue() == "" and silent._bar is None


def test_console_logger_prints_at_interval():
    stream = io.StringIO()
    trainer(max_duration="4ba", callbacks=[LRMonitor(), ConsoleLogger(log_interval="2ba", stream=stream)]).fit()
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("[batch]")]
    assert len(lines) == 2 and "batch=2" in lines[0] and "batch=4" in lines[1]
    assert "loss/train=" in lines[0] and "lr-SGD/group0=" in lines[0]
