"""`SpikeGuard(bisect=True)` in the local `Trainer`: a spike's window is replayed from the restored state on
halves of its rows until the planted rows are found; they are quarantined (in the checkpoint, and in a file a
later run passes), the rest of the window is trained, and later epochs never train them: the final model is
that of a run whose batches never held them. The search's pure part is tests/core/test_quarantine.py's."""

from __future__ import annotations

import json
import tempfile
from collections import Counter

import pytest
import torch
from test_spike_guard import BATCH, DIM, ROWS, Record, _rows
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.callbacks import SpikeGuard
from raytrain_events.checkpoint import CheckpointConfig
from raytrain_events.cli.main import main
from raytrain_events.core.callback import Callback
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.ledger import ledger_of_checkpoint
from raytrain_events.core.quarantine import Quarantine
from raytrain_events.core.spikes import Skipped
from raytrain_events.data.mixture_loader import MixtureLoader
from raytrain_events.models import ClassifierModel
from tests.data.test_mixture_trainer import MIXTURE, SOURCES, Rows, Tiny

PLANTED = [203, 317]  # batches 26 and 40 (1-based) of each epoch


def _fit(data, callbacks=(), duration="2ep", loader=None, **kw):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model = ClassifierModel(net, num_classes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model=model,
        train_dataloader=loader or DataLoader(data, batch_size=BATCH),
        max_duration=duration,
        optimizers=optimizer,
        schedulers=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99**step),
        callbacks=list(callbacks),
        seed=0,
        **kw,
    )
    return trainer.fit()


def test_bisection_quarantines_exactly_the_planted_rows_and_trains_the_rest(tmp_path):
    guard, record = SpikeGuard(snapshot_interval=5, bisect=True, row_key="id"), Record()
    state = _fit(_rows(planted=PLANTED), [record, guard])
    assert [(r["spike_batch"], r["restored_batch"], r["quarantined"], r["retrained"]) for r in guard.rollbacks] == [
        (26, 25, [203], True),
        (40, 37, [317], True),  # a fresh snapshot after a trained window: 27, 32, 37
    ]
    assert guard.quarantine.ids() == PLANTED and guard.skips.ranges == []  # nothing skipped: the window trained
    # The search: about 2x the window's rows forwarded (halves down to one row), well under 4x its compute.
    for r in guard.rollbacks:
        assert r["window_rows"] == BATCH * (r["batch"] - r["restored_batch"])
        assert r["search_rows"] <= 3 * r["window_rows"]
    # Epoch 1 never trains them (dropped from their batches); every other row once per epoch.
    epoch1 = sorted(i for (e, _), ids in record.lineage.items() if e == 1 for i in ids)
    assert epoch1 == [i for i in range(ROWS) if i not in PLANTED]
    # 2 out of the windows, 2 dropped in epoch 1: not trained, counted apart from the positions
    assert state.skipped.quarantined == 4 and state.skipped.samples == 0
    assert guard.trained(state) == {"batch": 2 * ROWS // BATCH, "sample": 2 * ROWS - 4, "token": 0}
    # The weights (and the schedule) of a run whose batches never held the planted rows.
    batches = [[i for i in range(b, b + BATCH) if i not in PLANTED] for b in range(0, ROWS, BATCH)]
    data = _rows(planted=PLANTED)
    clean = _fit(data, loader=DataLoader(data, batch_sampler=batches))
    for mine, theirs in zip(state.model.parameters(), clean.model.parameters()):
        assert torch.equal(mine, theirs)
    ts = state.timestamp  # positions counted as in the uninterrupted run
    assert (int(ts.epoch), int(ts.batch), int(ts.sample)) == (2, 2 * ROWS // BATCH, 2 * ROWS)

    # A later run on the same data passes the file: no spike at all, the rows dropped from the first batch on.
    path = tmp_path / "quarantine.json"
    path.write_text(guard.quarantine.dumps())
    later = SpikeGuard(snapshot_interval=5, row_key="id", quarantine_from=str(path))
    assert _fit(_rows(planted=PLANTED), [later], duration="1ep").skipped.quarantined == 2
    assert later.rollbacks == [] and later.quarantine.ids() == PLANTED
    # On other data (another dataset size) the file is refused at the fit's start.
    with pytest.raises(ValueError, match="quarantine was recorded for other data .*dataset_len: 400 there, 392 here"):
        _fit(_rows(drop=range(8)), [SpikeGuard(row_key="id", quarantine_from=str(path))])


def test_the_quarantine_holds_across_a_resume_and_the_ledger_answers_with_it(tmp_path, capsys):
    run = tmp_path / "run"
    config = CheckpointConfig(
        save_folder=str(run / "checkpoints"), save_interval="10ba", autoresume=True, async_save=False
    )
    first = SpikeGuard(snapshot_interval=5, bisect=True, row_key="id")
    _fit(_rows(planted=PLANTED), [first], duration="30ba", run_name="q", checkpoint=config)
    assert first.quarantine.ids() == [203]
    second, record = SpikeGuard(snapshot_interval=5, bisect=True, row_key="id"), Record()
    _fit(_rows(planted=PLANTED), [record, second], run_name="q", checkpoint=config)
    assert second.quarantine.ids() == PLANTED and [r["quarantined"] for r in second.rollbacks] == [[203], [317]]
    assert sorted(i for (e, _), ids in record.lineage.items() if e == 1 for i in ids) == [
        i for i in range(ROWS) if i not in PLANTED
    ]
    # The ledger (CLI): a culprit is quarantined from its window's start on; its window's other rows trained.
    assert main(["ledger", str(run), "--row", "train:203"]) == 0
    assert (
        capsys.readouterr().out.strip() == "train:203 trained 0 times before the checkpoint; quarantined in epochs 0, 1"
    )
    assert main(["ledger", str(run), "--row", "train:317", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined_in_epochs"] == [0, 1]
    assert main(["ledger", str(run), "--row", "train:210"]) == 0
    assert "trained 2 times" in capsys.readouterr().out
    # ... and writes the file a later run passes.
    path = tmp_path / "q.json"
    assert main(["ledger", str(run), "--export-quarantine", str(path)]) == 0
    assert "Wrote 2 quarantined rows" in capsys.readouterr().out
    assert Quarantine.loads(path.read_text()) == second.quarantine


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(bisect=True), "pass row_key='id'"),
        (dict(bisect=True, row_key="id", loss_ratio=None), "needs loss_ratio"),
        (dict(row_key="id", quarantine_from="/nonexistent/q.json"), "no such file"),
    ],
)
def test_bad_bisection_knobs_are_refused_before_any_work(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SpikeGuard(**kwargs)


def test_a_batch_without_the_row_key_is_named():
    data = [{"x": r["x"], "y": r["y"]} for r in _rows(planted=[203])]
    with pytest.raises(ValueError, match="integer column 'id'"):
        _fit(data, [SpikeGuard(snapshot_interval=5, bisect=True, row_key="id")], duration="1ep")


def test_a_batch_whose_every_row_is_quarantined_trains_with_its_loss_times_zero(tmp_path):
    """Every rank still runs its forward and backward (DDP needs it); the batch changes nothing: the model is
    that of a run without its rows (plain SGD: a zero gradient is no step)."""
    from test_spike_guard import _fit as fit_plain

    held = Quarantine(fingerprint={"row_key": "id"})
    for row in range(BATCH):  # the whole first batch
        held.add(row, 0, 0)
    path = tmp_path / "q.json"
    path.write_text(held.dumps())
    _, state = fit_plain(_rows(), [SpikeGuard(row_key="id", quarantine_from=str(path))])
    assert state.skipped.quarantined == BATCH and int(state.timestamp.sample) == ROWS
    _, without = fit_plain(_rows(drop=range(BATCH)))
    for mine, theirs in zip(state.model.parameters(), without.model.parameters()):
        assert torch.equal(mine, theirs)


class Tokens(Callback):
    """The tokens of every batch as read (before the quarantine drops rows) and as trained (after)."""

    def __init__(self):
        self.read, self.trained, self.read_rows, self.trained_ids = 0, 0, [], []

    def after_dataloader(self, state, logger):
        self.read += int(state.batch["len"].sum())
        self.read_rows.extend(zip(state.batch["id"].tolist(), state.batch["len"].tolist()))

    def batch_end(self, state, logger):  # after BATCH_START's filter: the rows trained
        self.trained += int(state.batch["len"].sum())
        self.trained_ids.extend(state.batch["id"].tolist())


def _with_len(rows):
    return [dict(row, len=1 + row["id"] % 7) for row in rows]


def test_quarantined_rows_tokens_are_counted_apart_by_bisection_and_by_the_filter():
    """Bisection's culprits (in their retrained window) and the rows the filter drops later: their tokens, counted
    by the loop's token counter, in ``state.skipped.quarantined_tokens``; trained tokens = the tokens trained."""
    data, record = _with_len(_rows(planted=PLANTED)), Tokens()
    guard = SpikeGuard(snapshot_interval=5, bisect=True, row_key="id")
    loader = DataSpec(DataLoader(data, batch_size=BATCH), get_num_tokens_in_batch=lambda b: int(b["len"].sum()))
    state = _fit(data, [record, guard], loader=loader)
    assert guard.quarantine.ids() == PLANTED and all(r["retrained"] for r in guard.rollbacks)
    culprit_tokens = sum(1 + i % 7 for i in PLANTED)  # 3 + 2: once in their windows, once dropped in epoch 1
    assert state.skipped.quarantined == 4 and state.skipped.quarantined_tokens == 2 * culprit_tokens
    assert int(state.timestamp.token) == record.read  # positions: every row read counts
    assert guard.trained(state)["token"] == record.read - 2 * culprit_tokens  # the culprits' tokens never trained
    saved = state.skipped.state_dict()
    assert saved["quarantined_tokens"] == 2 * culprit_tokens and Skipped.from_state_dict(saved) == state.skipped


def test_a_mixtures_quarantined_rows_are_counted_per_source_and_answered_by_the_ledger():
    """A 3-source `MixtureLoader` and a quarantine file: the dropped rows per source and their tokens
    (``tokens_of_row``) in ``state.skipped``, equal to what the batches held; trained = read - quarantined. With
    ``row_ids="mixture"`` (ids number the rows source after source) the ledger answers every ``SOURCE:N``: as
    often trained as the batches held it after the filter, and held in the epochs that read it."""
    log = []
    names = list(MIXTURE.names)  # the order the row ids number the sources in (`Mixture.names`: sorted)
    offsets = [sum(SOURCES[n] for n in names[:i]) for i in range(len(names))]
    datasets = {n: _Ided(Rows(i, SOURCES[n], log), offsets[i]) for i, n in enumerate(names)}
    loader = MixtureLoader(MIXTURE, datasets, batch_size=8, tokens_of_row=lambda row: int(row["len"]))
    held = list(range(3, sum(SOURCES.values()), 7))  # every 7th id: not the same rows under other offsets
    quarantine = Quarantine()
    for rid in held:
        quarantine.add(rid, 0, 0)
    record = Tokens()
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/q.json"
        with open(path, "w") as fh:
            fh.write(quarantine.dumps())
        guard = SpikeGuard(row_key="id", quarantine_from=path, row_ids="mixture")
        model = Tiny()
        state = Trainer(
            model=model,
            train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch),
            max_duration="2ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            callbacks=[record, guard],
            seed=7,
        ).fit()
    dropped = [(rid, n) for rid, n in record.read_rows if rid in set(held)]

    def source_row(rid):
        i = max(k for k in range(len(offsets)) if offsets[k] <= rid)
        return names[i], rid - offsets[i]

    by_source = {}
    for rid, _ in dropped:
        by_source[source_row(rid)[0]] = by_source.get(source_row(rid)[0], 0) + 1
    assert len(by_source) == 3 and state.skipped.quarantined == len(dropped)
    assert state.skipped.quarantined_by_source == by_source
    assert state.skipped.quarantined_tokens == sum(n for _, n in dropped) > 0
    assert int(state.timestamp.token) == record.read
    assert guard.trained(state)["token"] == record.trained == record.read - sum(n for _, n in dropped)
    # The ledger of the final state, for every row of every source, against the rows the batches trained.
    ledger = ledger_of_checkpoint(state.state_dict())
    trained, read = Counter(record.trained_ids), Counter(rid for rid, _ in record.read_rows)
    for rid in range(sum(SOURCES.values())):
        answer = ledger.ask(*source_row(rid))
        assert answer.times == trained[rid]
        assert len(answer.quarantined) == (read[rid] if rid in held else 0)
    assert sum(len(ledger.ask(*source_row(rid)).quarantined) for rid in held) == len(dropped) > 0


class _Ided:
    """A mixture source whose rows carry a row key ``id`` = the rows of the sources before it + row (and ``len``)."""

    def __init__(self, rows, offset):
        self.rows, self.offset = rows, offset

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, row):
        item = dict(self.rows[row])
        item["id"] = torch.tensor(self.offset + row)
        return item


def test_row_ids_is_refused_where_it_cannot_name_a_mixtures_rows():
    with pytest.raises(ValueError, match="row_ids='rows'"):
        SpikeGuard(row_key="id", row_ids="rows")
    with pytest.raises(ValueError, match="row_ids='mixture'"):
        SpikeGuard(row_ids="mixture")  # no row_key
    with pytest.raises(ValueError, match="trains no Mixture: drop row_ids"):  # at the fit's start, before a batch
        _fit(_rows(), [SpikeGuard(row_key="id", row_ids="mixture")], duration="1ba")


def test_a_skipped_window_takes_back_the_quarantined_rows_it_held():
    """Row 201 is quarantined (dropped from batch 26) and row 203 spikes that batch: the window skipped holds the
    dropped row, so it counts once, as skipped (rows and tokens), not also as quarantined."""
    path = tempfile.mkdtemp() + "/q.json"
    quarantine = Quarantine()
    quarantine.add(201, 0, 0)
    with open(path, "w") as fh:
        fh.write(quarantine.dumps())
    data, record = _with_len(_rows(planted=[203])), Tokens()
    guard = SpikeGuard(snapshot_interval=5, row_key="id", quarantine_from=path)
    loader = DataSpec(DataLoader(data, batch_size=BATCH), get_num_tokens_in_batch=lambda b: int(b["len"].sum()))
    state = _fit(data, [record, guard], loader=loader, duration="1ep")
    ((epoch, start, end),) = guard.rollbacks[0]["skipped"]
    assert epoch == 0 and start <= 201 < end and len(guard.rollbacks) == 1
    window_tokens = sum(1 + i % 7 for i in range(start, end))
    skipped = state.skipped
    assert (skipped.quarantined, skipped.quarantined_tokens, skipped.samples) == (0, 0, end - start)
    assert skipped.tokens == window_tokens and guard.trained(state)["token"] == record.read - window_tokens
