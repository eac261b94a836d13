"""The progress watchdog and the preemption guard on a local `Trainer` (no Ray): what they write and decide."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint import CheckpointConfig, list_checkpoints
from raytrain_events.core.heartbeat import HEARTBEAT, Heartbeat
from raytrain_events.dist import LocalDist
from raytrain_events.models import ClassifierModel
from raytrain_events.ray.guards.health import missing_ranks
from raytrain_events.ray.guards.preemption import PreemptionGuard
from raytrain_events.ray.guards.watchdog import (
    ProgressWatchdog,
    default_hang_timeout,
    process_group_timeout_s,
    slowest_rank,
)


def _trainer(callbacks, checkpoint=None, batches=8):
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    data = TensorDataset(torch.randn(8 * batches, 4), torch.randint(0, 2, (8 * batches,)))
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=callbacks,
        checkpoint=checkpoint,
    )


class _StuckAt(Callback):
    """Blocks the loop mid-batch after ``batch`` batches (in ``_stuck_here``) until ``release`` is set; as it gets
    stuck, sets ``watchdog``'s hang timeout to ``timeout_s`` (until then its own, long one: a batch before the stuck
    one that a loaded machine stalls past a 0.5 s timeout must not fire it)."""

    def __init__(self, batch: int, watchdog=None, timeout_s: float = 0.5) -> None:
        self.batch, self.release = batch, threading.Event()
        self.watchdog, self.timeout_s = watchdog, timeout_s

    def after_dataloader(self, state, logger) -> None:
        if int(state.timestamp.batch) == self.batch:
            if self.watchdog is not None:
                self.watchdog.hang_timeout = self.timeout_s
            self._stuck_here()

    def _stuck_here(self) -> None:
        assert self.release.wait(60), "the watchdog never fired"


def test_a_stuck_loop_is_dumped_named_and_ended(tmp_path):
    fired = []

    def on_hang(summary):
        fired.append(summary)
        stuck.release.set()

    watchdog = ProgressWatchdog(
        hang_timeout=10.0, dump_url=str(tmp_path / "hangs"), rank=0, world_size=1, grace_s=0.5, on_hang=on_hang
    )
    stuck = _StuckAt(2, watchdog, timeout_s=0.5)  # 0.5 s from the stuck batch on (checked every 0.5 s until then)
    _trainer([stuck, watchdog]).fit()
    assert len(fired) == 1
    dump = (tmp_path / "hangs" / "rank-0.txt").read_text()
    record = json.loads(dump.split("\n", 1)[0])
    assert record["batch"] == 2 and record["collective"] is None and record["idle_s"] >= 0.5
    assert "_stuck_here" in record["frame"] and "test_watchdog_local.py" in record["frame"]
    assert "--- all threads (faulthandler) ---" in dump and "raytrain-watchdog" not in record["frame"]
    summary = (tmp_path / "hangs" / "summary.txt").read_text()
    assert summary == fired[0]
    assert "Slowest rank: 0" in summary and "_stuck_here" in summary and "at batch 2" in summary


def test_a_steady_loop_never_fires(tmp_path):
    fired = []
    watchdog = ProgressWatchdog(
        hang_timeout=5.0, dump_url=str(tmp_path / "hangs"), rank=0, world_size=1, on_hang=fired.append
    )
    _trainer([watchdog], batches=20).fit()
    assert not fired and not (tmp_path / "hangs").exists()
    assert watchdog._thread is not None
    watchdog._thread.join(5)
    assert not watchdog._thread.is_alive()  # close() ends the watching thread


def test_slowest_rank_prefers_absent_then_fewest_batches_then_not_in_a_collective():
    def rec(batch, collective, idle):
        return {"batch": batch, "collective": collective, "idle_s": idle}

    waiting = rec(8, "all_reduce", 20.0)
    assert slowest_rank({0: waiting, 2: waiting}, 3) == 1  # rank 1 sent nothing: frozen
    assert slowest_rank({0: waiting, 1: rec(7, "all_reduce", 21.0), 2: waiting}, 3) == 1
    assert slowest_rank({0: waiting, 1: rec(8, None, 19.0)}, 2) == 1
    assert slowest_rank({0: rec(8, None, 19.0), 1: rec(8, None, 25.0)}, 2) == 1


def test_slowest_rank_is_the_one_behind_in_the_loop_whatever_the_dump_times():
    """Seen in CI: rank 1 blocked right after batch 9's checkpoint, rank 0 already in batch 10's backward
    (DDP's all-reduce waits there, unmarked); rank 0 dumped later, so its idle time looked longer."""
    blocked = {"batch": 9, "label": "batch_checkpoint", "collective": None, "idle_s": 12.0, "last_wall": 100.00}
    waiting = {"batch": 9, "label": "after_dataloader", "collective": None, "idle_s": 12.4, "last_wall": 100.01}
    assert slowest_rank({0: waiting, 1: blocked}, 2) == 1
    # Same point in the loop: the earliest last beat, by wall time, not by each dump's idle time.
    early = dict(blocked, idle_s=11.0, last_wall=99.0)
    assert slowest_rank({0: blocked, 1: early}, 2) == 1


def test_timeouts_follow_the_steps_and_the_process_group_waits_longer():
    assert default_hang_timeout([]) == 300.0
    assert default_hang_timeout([0.1] * 50) == 300.0
    assert default_hang_timeout([30.0, 31.0, 29.0]) == 20 * 30.0
    assert process_group_timeout_s(None) == 1800.0
    assert process_group_timeout_s(20.0) > 20.0 + 10.0  # dumps and the grace period fit before it
    with pytest.raises(ValueError, match="hang_timeout"):
        ProgressWatchdog(hang_timeout=0, dump_url="x", rank=0, world_size=1)


def test_heartbeat_marks_the_collective_in_flight():
    beat = Heartbeat()
    beat.beat("batch_end", 4)
    with beat.collective("all_reduce (mean)"):
        inside = beat.snapshot()
    assert inside["collective"] == "all_reduce (mean)" and inside["batch"] == 4
    assert beat.snapshot()["collective"] is None and beat.snapshot()["beats"] == 1


def test_missing_ranks_from_the_monitored_barrier_message():
    assert missing_ranks("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms") == [1, 3]
    assert missing_ranks("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 10 ms") == [2]
    assert missing_ranks("Connection closed by peer") == []


def test_a_preemption_notice_saves_at_the_next_batch_and_trains_on(tmp_path):
    folder = str(tmp_path / "run" / "checkpoints")
    notices = iter([None, None, {"cause": "preemption notice", "detail": "node x"}])
    guard = PreemptionGuard(
        dist=LocalDist(), run_url=str(tmp_path / "run"), sigterm=False, notice_fn=lambda: next(notices, None)
    )
    config = CheckpointConfig(save_folder=folder, save_final=False, save_every_n_seconds=None)
    state = _trainer([guard], checkpoint=config).fit()
    # Noticed before batch 3's collective: saved at batch 3, one save per notice, trained to the end.
    assert [c.batch for c in list_checkpoints(folder)] == [3]
    assert int(state.timestamp.batch) == 8
    (record,) = guard.records
    assert record["cause"] == "preemption notice" and record["saved_batch"] == 3 and not record["stopping"]
    assert 0 <= record["notice_to_commit_s"] < 30
    assert json.loads((tmp_path / "run" / "preemptions" / "batch-3.json").read_text()) == record


def test_a_sigterm_noted_by_the_handler_saves_and_stops(tmp_path, monkeypatch):
    from raytrain_events.ray.guards import preemption

    folder = str(tmp_path / "run" / "checkpoints")
    guard = PreemptionGuard(dist=LocalDist(), run_url=str(tmp_path / "run"), sigterm=False, notice_fn=lambda: None)

    class SigtermAt(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 2:
                preemption._on_sigterm(15, None)  # what the handler on the main thread does

    monkeypatch.setattr(preemption, "_SIGTERM", {})
    config = CheckpointConfig(save_folder=folder, save_final=False, save_every_n_seconds=None)
    state = _trainer([SigtermAt(), guard], checkpoint=config).fit()
    assert [c.batch for c in list_checkpoints(folder)] == [3] and int(state.timestamp.batch) == 3
    assert guard.records[0]["cause"] == "SIGTERM" and guard.records[0]["stopping"]
    assert os.path.exists(tmp_path / "run" / "preemptions" / "batch-3.json")
    assert HEARTBEAT is not None


def test_the_sigterm_handler_notes_the_signal_at_once_and_restores_the_previous_one():
    import signal

    from raytrain_events.ray.guards import preemption

    before = signal.getsignal(signal.SIGTERM)
    assert preemption._install_handler()
    try:
        assert not preemption._sigterm_arrived()
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only notes it
        assert preemption._sigterm_arrived() and preemption._SIGTERM["wall"] > 0
    finally:
        preemption._restore_handler()
        preemption._SIGTERM.clear()
    assert signal.getsignal(signal.SIGTERM) is before and preemption._wakeup is None
