"""`SpikeGuard` in the local `Trainer`: a planted row spikes the loss; the run rolls back from its host
snapshot, skips exactly the window's rows, trains every other row once, and ends at the uninterrupted
run's Timestamp with the model of a run that never saw the window; a second spike widens the window,
a bound stops the run naming the rows, a resume keeps the skip list. (Every rank agreeing at the same
batch is the Ray test's: tests/ray/test_spike_run.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

from raytrain_events import Callback, Event, Trainer
from raytrain_events.callbacks import SpikeGuard, SpikeRollbackError
from raytrain_events.checkpoint import CheckpointConfig, list_checkpoints
from raytrain_events.cli.main import main
from raytrain_events.core.spikes import SkipRange
from raytrain_events.models import ClassifierModel

ROWS, DIM, BATCH = 400, 4, 8  # 50 batches; row 203 is in batch 25 (0-based), rows [200, 208)


def _rows(planted=(), nan=(), drop=range(0)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, DIM, generator=g)
    y = (x[:, 0] > 0).long()
    for i in planted:  # a huge input with the wrong label: a loss in the hundreds
        x[i], y[i] = x[i] * 1e4, 1 - y[i]
    for i in nan:
        x[i] = math.nan
    return [{"id": i, "x": x[i], "y": y[i]} for i in range(ROWS) if i not in drop]


class Record(Callback):
    """``{(epoch, batch_in_epoch): ids}`` of every trained batch, the last training of a position kept."""

    def __init__(self, into=None):
        self.lineage = {} if into is None else into

    def batch_end(self, state, logger):
        ts = state.timestamp
        self.lineage[(int(ts.epoch), int(ts.batch_in_epoch))] = state.batch["id"].tolist()


def _fit(data, callbacks=(), duration="1ep", scheduler=False, dropout=False, **kw):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    if dropout:  # the RNG drives the forward: a rollback must restore it exactly
        net.insert(2, torch.nn.Dropout(0.5))
    model = ClassifierModel(net, num_classes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedulers = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.98**step) if scheduler else None
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=BATCH),
        max_duration=duration,
        optimizers=optimizer,
        schedulers=schedulers,
        callbacks=list(callbacks),
        **{"seed": 0, **kw},
    )
    return trainer, trainer.fit()


def _trained_ids(lineage, guard):
    """Ids of the positions that stayed trained (a skipped position's record is of a rolled-back batch)."""
    ids = []
    for (epoch, batch), batch_ids in sorted(lineage.items()):
        end = batch * BATCH
        if not guard.skips.contains(epoch, end - 1):
            ids += batch_ids
    return ids


def test_a_spike_rolls_back_from_host_and_skips_exactly_its_window():
    guard, record = SpikeGuard(snapshot_interval=5), Record()
    trainer, state = _fit(_rows(planted=[203]), [record, guard], dropout=True)  # dropout: the RNGs restored too
    assert trainer.engine.active_events()[Event.AFTER_TRAIN_BATCH]  # the gradient norm, before the optimizer step
    # Seen at batch 26 (rows [200, 208)), agreed one batch later: the snapshot of batch 25 restored.
    assert [(r["spike_batch"], r["restored_batch"], r["from"]) for r in guard.rollbacks] == [(26, 25, "host")]
    assert "loss" in guard.rollbacks[0]["reason"]
    assert guard.skips.ranges == [SkipRange(0, 200, 216, batches=2, tokens=0)]
    # Every other row trained once; the Timestamp is the uninterrupted run's; trained = Timestamp - skipped.
    ids = _trained_ids(record.lineage, guard)
    assert sorted(ids) == [i for i in range(ROWS) if not 200 <= i < 216]
    _, clean = _fit(_rows())
    assert state.timestamp == clean.timestamp
    assert guard.trained(state) == {"batch": 48, "sample": 384, "token": 0}
    # Not trained, counted apart from the Timestamp (whose positions are the uninterrupted run's).
    assert state.skipped.state_dict() == {"batches": 2, "samples": 16, "tokens": 0, "quarantined": 0, "by_source": {}}
    # The weights are those of a run that never saw the window (host restore: model, optimizer and RNGs exact:
    # the dropout masks after the rollback are those the run without the window draws).
    _, without = _fit(_rows(drop=range(200, 216)), dropout=True)
    for mine, theirs in zip(state.model.parameters(), without.model.parameters()):
        assert torch.equal(mine, theirs)


def test_loss_only_on_the_cpu_runs_no_hook_before_the_step_and_the_default_interval_reaches_back_further():
    """``AFTER_TRAIN_BATCH`` costs an event a batch: the guard takes it only with a job there (the gradient norm,
    as in the test above, a replica group's verdict, an accelerator's loss copy); loss only on the CPU the Engine
    skips it and batch_end reads the loss. The default snapshot_interval (50: the snapshot's cost under 1% of
    ~1 ms steps) snapshots at the fit's start and every 50 batches: the spike at batch 26 restores batch 0's
    state and skips the 27 batches since (at 20 it would have restored batch 20's, 7 batches)."""
    guard = SpikeGuard(grad_zscore=None)
    trainer, state = _fit(_rows(planted=[203]), [guard])
    assert not trainer.engine.active_events()[Event.AFTER_TRAIN_BATCH]
    assert guard.snapshot_interval == 50
    assert [(r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 0)]
    assert guard.skips.ranges == [SkipRange(0, 0, 216, batches=27, tokens=0)]
    assert guard.trained(state) == {"batch": 23, "sample": 184, "token": 0}


class Unjudged(Callback):
    """The snapshots still waiting for good batches (``meta["unjudged"]``), as the guard's last BATCH_END left them
    (the guard runs last among the callbacks: this one sees them before the guard's next)."""

    def __init__(self, guard):
        self.guard, self.waiting = guard, []

    def batch_end(self, state, logger):
        self.waiting.append([s.meta["unjudged"] for s in self.guard._snapshots.snapshots if s.meta["unjudged"]])


@pytest.mark.parametrize("grad_zscore", [6.0, None])
def test_with_the_norm_judged_no_snapshot_waits_so_batch_end_skips_the_count(grad_zscore):
    """``batch_end`` counts the agreed-good batches for the waiting snapshots (`spike_rollback.judged_good`) only when
    judging the loss alone: with the gradient norm judged a snapshot is a rollback target when taken (``owed`` 0), so
    none ever waits, before or after a rollback; loss only, every new snapshot waits for two."""
    guard = SpikeGuard(snapshot_interval=5, grad_zscore=grad_zscore)
    watch = Unjudged(guard)
    _fit(_rows(planted=[203]), [watch, guard])
    assert len(guard.rollbacks) == 1 and len(watch.waiting) == ROWS // BATCH
    if grad_zscore is not None:
        assert watch.waiting == [[]] * (ROWS // BATCH)
    else:  # the fit's first snapshot waits (2), then each new one
        assert watch.waiting[0] == [2] and sum(map(bool, watch.waiting)) > 10


class Owed(Callback):
    """The guard's bound on the batches its snapshots still owe (``_unjudged``) beside what each one owes, as the
    guard's last BATCH_END left them."""

    def __init__(self, guard):
        self.guard, self.seen = guard, []

    def batch_end(self, state, logger):
        self.seen.append((self.guard._unjudged, [s.meta["unjudged"] for s in self.guard._snapshots.snapshots]))


@pytest.mark.parametrize("grad_zscore", [6.0, None])
def test_the_guards_bound_on_owed_batches_covers_every_snapshot_so_batch_end_skips_the_walk(grad_zscore):
    """``batch_end`` calls `judged_good` only while ``guard._unjudged`` > 0: that bound is never below what any
    snapshot still owes (before and after a rollback), so the skipped walk would have changed nothing; with the
    norm judged it is 0 at every batch, loss only it is 0 but in the 2 batches after each snapshot."""
    guard = SpikeGuard(snapshot_interval=5, grad_zscore=grad_zscore)
    watch = Owed(guard)
    _fit(_rows(planted=[203]), [watch, guard])
    assert len(guard.rollbacks) == 1 and len(watch.seen) == ROWS // BATCH
    assert all(bound >= max(owed, default=0) for bound, owed in watch.seen)
    busy = sum(1 for bound, _ in watch.seen if bound)
    if grad_zscore is not None:
        assert busy == 0
    else:  # two batches of every five (a snapshot each 5), the rollback's restart too
        assert 15 <= busy <= 25, busy


def test_a_schedule_follows_the_position_and_a_nan_row_rolls_back_too():
    guard = SpikeGuard(snapshot_interval=4)
    trainer, state = _fit(_rows(nan=[100]), [guard], scheduler=True)
    assert guard.skips.ranges == [SkipRange(0, 96, 112, batches=2, tokens=0)]
    assert "not finite" in guard.rollbacks[0]["reason"]
    assert all(torch.isfinite(p).all() for p in state.model.parameters())
    _, clean = _fit(_rows(), scheduler=True)
    assert state.optimizers[0].param_groups[0]["lr"] == pytest.approx(clean.optimizers[0].param_groups[0]["lr"])


def test_a_second_spike_right_after_widens_the_window_and_a_bound_stops_the_run():
    guard, record = SpikeGuard(snapshot_interval=5), Record()
    _, state = _fit(_rows(planted=[203, 219]), [record, guard])
    # Rows [216, 224) follow the first window: they spike right after it, the same snapshot is restored.
    assert [r["restored_batch"] for r in guard.rollbacks] == [25, 25]
    assert guard.skips.ranges == [SkipRange(0, 200, 216, 2, 0), SkipRange(0, 216, 232, 2, 0)]
    assert sorted(_trained_ids(record.lineage, guard)) == [i for i in range(ROWS) if not 200 <= i < 232]
    with pytest.raises(SpikeRollbackError, match=r"after 1 rollbacks .*epoch 0 rows \[200, 216\)"):
        _fit(_rows(planted=[203, 219]), [SpikeGuard(snapshot_interval=5, max_rollbacks=1)])


def test_a_resume_after_the_rollback_keeps_the_skip_list(tmp_path, capsys):
    folder = str(tmp_path / "run" / "checkpoints")
    lineage = {}
    config = dict(save_folder=folder, save_interval="10ba", autoresume=True, async_save=False)
    first = SpikeGuard(snapshot_interval=5)
    _fit(
        _rows(planted=[203]),
        [Record(lineage), first],
        duration="30ba",
        run_name="r",
        checkpoint=CheckpointConfig(**config),
    )
    assert first.skips.ranges == [SkipRange(0, 200, 216, 2, 0)]
    second = SpikeGuard(snapshot_interval=5)
    _, state = _fit(
        _rows(planted=[203]), [Record(lineage), second], run_name="r", checkpoint=CheckpointConfig(**config)
    )
    assert second.skips.ranges == first.skips.ranges and len(second.rollbacks) == 1  # from the checkpoint
    assert sorted(_trained_ids(lineage, second)) == [i for i in range(ROWS) if not 200 <= i < 216]
    _, clean = _fit(_rows())
    assert state.timestamp == clean.timestamp
    # Resumed with another seed, the skip list's positions would name other rows: refused at the fit's start.
    with pytest.raises(ValueError, match="other data .*seed: 0 there, 1 here"):
        _fit(_rows(), [SpikeGuard()], run_name="r", checkpoint=CheckpointConfig(**config), seed=1, duration="2ep")
    # The ledger, from the command line: row 203 was skipped, row 5 trained once; the first run's checkpoint
    # at batch 20 predates the rollback (row 203 not reached yet).
    run = str(tmp_path / "run")
    assert main(["ledger", run, "--row", "train:203"]) == 0
    assert (
        capsys.readouterr().out.strip()
        == "train:203 trained 0 times before the checkpoint; skipped by a rollback in epochs 0"
    )
    assert main(["ledger", run, "--row", "train:5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epochs"] == [0]
    early = next(c for c in list_checkpoints(folder) if c.batch == 20)
    assert main(["ledger", run, "--row", "train:150", "--checkpoint", early.name]) == 0
    assert "trained 1 times" in capsys.readouterr().out
    assert main(["ledger", run, "--row", "train:170", "--checkpoint", early.name]) == 0
    assert "trained 0 times" in capsys.readouterr().out
    assert main(["ledger", run, "--row", "web:1"]) == 2
    assert "No source 'web'" in capsys.readouterr().err
    assert main(["ledger", run, "--row", "train"]) == 2
    assert "not SOURCE:N" in capsys.readouterr().err


def test_a_checkpoint_from_before_state_skipped_counts_its_skip_list():
    """Checkpoints written before `State.skipped` have no such entry: they load as zeros, and the guard's fit
    start fills the counts from its skip list."""
    from raytrain_events.core.spikes import Skipped

    guard = SpikeGuard(snapshot_interval=5)
    trainer, state = _fit(_rows(planted=[203]), [guard], duration="30ba")
    old = state.state_dict()
    del old["skipped"]
    state.skipped = Skipped(batches=99)
    state.load_state_dict(old)
    assert state.skipped == Skipped()
    trainer.fit(duration="1ba")
    assert (state.skipped.batches, state.skipped.samples) == (2, 16)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(snapshot_interval=0), "snapshot_interval=0 must be an integer >= 1"),
        (dict(snapshot_interval=None), "snapshot_interval=None"),
        (dict(window=0), "window=0"),
        (dict(loss_ratio=-2.0), "loss_ratio=-2.0"),
        (dict(grad_zscore=0), "grad_zscore=0"),
        (dict(max_rollbacks=0), "max_rollbacks=0"),
        (dict(max_window=0), "max_window=0"),
    ],
)
def test_bad_guard_knobs_are_refused_before_any_work(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SpikeGuard(**kwargs)


@pytest.mark.parametrize("duration", ["1ep", "50ba"])
def test_a_spike_in_the_fits_last_batch_is_rolled_back_before_the_final_save(tmp_path, duration):
    """No next batch carries the agreement: at the fit's last batch (BATCH_END for '50ba', EPOCH_END for
    '1ep', before the epoch's checkpoint) the ranks sum the flag once, roll back and skip the window; the
    final state and the checkpoint saved at the end are those of a run that never saw the window."""
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files
    from raytrain_events.storage.run_dir import STATE_FILE

    folder = str(tmp_path / "ck")
    guard = SpikeGuard(snapshot_interval=5)
    config = CheckpointConfig(save_folder=folder, save_interval=duration, async_save=False)
    trainer, state = _fit(_rows(planted=[396]), [guard], duration=duration, checkpoint=config, run_name="last")
    # Seen at batch 50, the last: snapshots at 40 and 45 kept, the one of 45 restored, batches 46-50 skipped.
    assert [(r["spike_batch"], r["restored_batch"], r["batch"]) for r in guard.rollbacks] == [(50, 45, 50)]
    assert guard.skips.ranges == [SkipRange(0, 360, 400, batches=5, tokens=0)]
    _, without = _fit(_rows(drop=range(360, 400)))
    for mine, theirs in zip(state.model.parameters(), without.model.parameters()):
        assert torch.equal(mine, theirs)
    (saved,) = list_checkpoints(folder)
    assert saved.batch == 50
    files = read_checkpoint_files(saved, files=[STATE_FILE]).files[STATE_FILE]
    assert files["callbacks"]["SpikeGuard"]["skips"]["ranges"] == [[0, 360, 400, 5, 0]]
    trainer.fit(duration="2ba")  # the next fit of the same Trainer goes on from the rolled-back state
    assert int(trainer.state.timestamp.batch) == 52 and len(guard.rollbacks) == 1


@pytest.mark.parametrize("threshold", [0.05, 1.0])
def test_with_gradient_clipping_the_guard_shares_its_norm_and_decides_the_same(monkeypatch, threshold):
    """GradientClipping computes the gradient norm anyway: the guard judges that one (its pre-clip norm)
    instead of a second pass over the gradients, and decides as when it computes its own (before the clip)."""
    from raytrain_events.algorithms import GradientClipping
    from raytrain_events.callbacks import spike_norm

    def run(share):
        calls = []
        norm = spike_norm.vector_norm
        monkeypatch.setattr(spike_norm, "vector_norm", lambda *a, **k: calls.append(1) or norm(*a, **k))
        if not share:
            monkeypatch.setattr(spike_norm, "shared_clipping", lambda state, params: None)
        guard = SpikeGuard(snapshot_interval=5)
        _fit(_rows(planted=[203]), [guard], algorithms=[GradientClipping("norm", threshold)])
        monkeypatch.undo()
        return guard, len(calls)

    (shared, shared_calls), (own, own_calls) = run(True), run(False)
    assert shared_calls == 0 and own_calls > 50  # one norm per parameter tensor per batch when not shared
    assert shared.rollbacks == own.rollbacks and shared.skips.ranges == own.skips.ranges
    assert len(shared.detector._norms) == len(own.detector._norms) > 10
    assert list(shared.detector._norms) == pytest.approx(list(own.detector._norms), rel=1e-6)
    assert max(own.detector._norms) > threshold  # the judged norm is the one before clipping


@pytest.mark.parametrize("share", [True, False])
def test_with_gradient_clipping_on_the_cpu_the_norm_is_read_at_batch_end_without_a_hook_before_the_step(
    monkeypatch, share
):
    """With a GradientClipping the guard's norm is the clipping's pre-clip one (shared) or its own taken at
    AFTER_BACKWARD: on the CPU the guard has nothing left to do at AFTER_TRAIN_BATCH and takes no hook there (the
    event still runs, for the clipping), ``batch_end`` reads the norm, and the decisions and the judged norms are
    those of the guard reading it there (its hook forced back on)."""
    from raytrain_events.algorithms import GradientClipping
    from raytrain_events.callbacks import spike_norm

    def run(hook):
        if not share:
            monkeypatch.setattr(spike_norm, "shared_clipping", lambda state, params: None)
        if hook:  # the hook before the step taken as before: after_train_batch reads the norm
            monkeypatch.setattr(SpikeGuard, "overridden_events", Callback.overridden_events)
            monkeypatch.setattr(SpikeGuard, "fit_start", _norm_before_step(SpikeGuard.fit_start))
        guard = SpikeGuard(snapshot_interval=5, loss_ratio=None, grad_zscore=6.0)  # the norm alone decides
        _fit(_rows(planted=[203]), [guard], algorithms=[GradientClipping("norm", 0.5)])
        hooked = Event.AFTER_TRAIN_BATCH in guard.overridden_events()
        monkeypatch.undo()
        return guard, hooked

    (at_end, hooked_end), (before, hooked_before) = run(False), run(True)
    assert not hooked_end and hooked_before
    assert [(r["spike_batch"], r["restored_batch"]) for r in at_end.rollbacks] == [(26, 25)]
    assert at_end.rollbacks == before.rollbacks
    assert at_end.skips.ranges == before.skips.ranges
    assert list(at_end.detector._norms) == list(before.detector._norms) and len(at_end.detector._norms) > 10


def _norm_before_step(fit_start):
    def patched(self, state, logger):
        fit_start(self, state, logger)
        self._before_step, self._norm_at_end = True, False

    return patched


@pytest.mark.parametrize("share", [True, False])
def test_with_gradient_clipping_a_gradient_blow_up_is_judged_before_the_clip(monkeypatch, share):
    """Gradient norm only (no loss test): the planted row's gradient is capped by a tight clipping; judged
    after the clip (the old behaviour) every norm is the threshold and nothing spikes; judged before it, the
    blow-up rolls back and skips its window."""
    from raytrain_events.algorithms import GradientClipping
    from raytrain_events.callbacks import spike_norm

    if not share:  # the guard's own norm, taken at AFTER_BACKWARD
        monkeypatch.setattr(spike_norm, "shared_clipping", lambda state, params: None)
    guard = SpikeGuard(snapshot_interval=5, loss_ratio=None, grad_zscore=6.0)
    _fit(_rows(planted=[203]), [guard], algorithms=[GradientClipping("norm", 0.5)])
    assert [(r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 25)]
    assert "gradient norm" in guard.rollbacks[0]["reason"]
    assert guard.skips.ranges == [SkipRange(0, 200, 216, batches=2, tokens=0)]


@pytest.mark.parametrize("grad_zscore", [6.0, None])
def test_the_cuda_read_path_decides_as_the_direct_read(monkeypatch, grad_zscore):
    """On CUDA the loss and norm reach batch_end through a pinned buffer and an event (no wait on the
    optimizer step); with the GPU mocked (an event that records, an unpinned buffer) the decisions and the
    window are those of the direct read."""
    from raytrain_events.callbacks import spike_guard

    recorded = []

    class Event:
        def record(self):
            recorded.append(1)

        def synchronize(self):
            pass

    class OnCuda(SpikeGuard):
        def init(self, state, logger):
            super().init(state, logger)
            self._before_step = True  # what a CUDA model gets: the loss's copy starts before the optimizer step

        def after_train_batch(self, state, logger):
            super().after_train_batch(state, logger)
            self._to_host(state.loss, self._norm)  # what a CUDA loss takes

    empty = torch.empty
    monkeypatch.setattr(spike_guard.torch.cuda, "Event", Event)
    monkeypatch.setattr(spike_guard.torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    direct, via_host = (
        SpikeGuard(snapshot_interval=5, grad_zscore=grad_zscore),
        OnCuda(snapshot_interval=5, grad_zscore=grad_zscore),
    )
    _fit(_rows(planted=[203]), [direct])
    _fit(_rows(planted=[203]), [via_host])
    assert len(recorded) == 50  # one copy a batch
    assert via_host.rollbacks == direct.rollbacks and via_host.skips.ranges == direct.skips.ranges
    assert via_host.detector.state_dict() == direct.detector.state_dict()


class BlowUpAfterStep(Callback):
    """At ``BATCH_END`` of batch ``at`` (after its optimizer step, its loss finite): the weights blown up, as a
    gradient blow-up the loss alone cannot see leaves them. The guard's snapshot of that batch holds the damage."""

    def __init__(self, at):
        self.at = at

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.at:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in state.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 100)


def test_judging_the_loss_alone_a_snapshot_taken_after_a_blow_up_is_passed_over():
    """The spike shows at batch 26 (the damaged weights' first loss); the snapshot of batch 25 holds the damage:
    no batch trained from it was judged good, so the rollback lands on batch 20's (main: on 25's, again and
    again, until max_rollbacks stops the run)."""
    guard = SpikeGuard(snapshot_interval=5, grad_zscore=None)
    _, state = _fit(_rows(), [BlowUpAfterStep(25), guard])
    assert [(r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 20)]
    assert guard.skips.ranges == [SkipRange(0, 160, 216, batches=7, tokens=0)]
    _, clean = _fit(_rows())
    assert state.timestamp == clean.timestamp
    assert guard.trained(state) == {"batch": 43, "sample": 344, "token": 0}
    _, without = _fit(_rows(drop=range(160, 216)))  # the weights of a run that never trained the window
    for mine, theirs in zip(state.model.parameters(), without.model.parameters()):
        assert torch.equal(mine, theirs)
