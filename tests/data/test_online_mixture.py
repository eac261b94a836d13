"""`Mixture(online=...)` through the local `Trainer`: the policy changes the weights at eval boundaries, the run
trains the changed order, and a crash resumed from a checkpoint ends with the same weights history, per-source
counts, rows and Timestamp; the checkpoint's ledger answers over the history."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torchmetrics
from png_checks import check_png

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.ledger import ledger_of_checkpoint
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.time import COUNTER_UNITS
from raytrain_events.data.mixture_counts import MixtureCounts
from raytrain_events.data.mixture_loader import MixtureLoader
from raytrain_events.data.online_mixture import OnlineMixture
from raytrain_events.report import write_report
from raytrain_events.trainer.evaluation import Evaluator

SOURCES = {"web": 100, "code": 60, "math": 80}
MIXTURE = Mixture(
    sources=SOURCES,
    weights={"web": 0.6, "code": 0.3, "math": 0.1},
    epoch_size=160,
    online={"policy": "exp3", "rate": 3.0},
)


class Rows:
    """Source ``source``'s rows: features, a label by the source's own rule, and the row's id."""

    def __init__(self, source: int, rows: int, offset: int = 0):
        self.source, self.rows, self.offset = source, rows, offset

    def __len__(self):
        return self.rows

    def __getitem__(self, row):
        g = torch.Generator().manual_seed(self.source * 1000 + row + self.offset)
        x = torch.randn(4, generator=g)
        return {"x": x, "y": torch.tensor(int(x[self.source] > 0)), "id": torch.tensor([self.source, row])}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, batch):
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch["y"])

    def get_metrics(self, is_train=False):
        return {"loss": torchmetrics.MeanMetric()}

    def update_metric(self, batch, outputs, metric):
        metric.update(torch.nn.functional.cross_entropy(outputs, batch["y"]), weight=len(batch["y"]))


class Seen(Callback):
    def __init__(self, crash_at=None):
        self.rows, self.crash_at = [], crash_at

    def after_dataloader(self, state, logger):
        self.rows.extend((state.epoch, *map(int, i)) for i in state.batch["id"])

    def batch_end(self, state, logger):
        if state.step == self.crash_at:
            raise RuntimeError("simulated crash")


def evaluators(labels=None):
    out = []
    for i, name in enumerate(MIXTURE.names):
        held_out = [Rows(i, 40, offset=500)[j] for j in range(40)]
        label = (labels or {}).get(name, name)
        out.append(
            Evaluator(label=label, dataloader=torch.utils.data.DataLoader(held_out, batch_size=20), eval_interval="5ba")
        )
    return out


def make(folder=None, crash_at=None, mixture=MIXTURE, labels=None, extra=()):
    datasets = {name: Rows(i, SOURCES[name]) for i, name in enumerate(MIXTURE.names)}  # ids: the plan's indices
    loader = MixtureLoader(mixture, datasets, batch_size=8)
    seen, model = Seen(crash_at), Tiny()
    checkpoint = None
    if folder is not None:
        checkpoint = CheckpointConfig(save_folder=folder, save_interval="7ba", autoresume=True, async_save=False)
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader),
        eval_dataloader=evaluators(labels) + list(extra),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.2),
        callbacks=[seen],
        checkpoint=checkpoint,
        seed=3,
    )
    return trainer, seen, loader


def _one(trainer, kind):
    (callback,) = [c for c in trainer.state.callbacks if isinstance(c, kind)]
    return callback


def test_an_online_mixture_changes_its_weights_and_resumes_exactly(tmp_path):
    full, full_seen, full_loader = make()
    full.fit()
    history = _one(full, OnlineMixture).changes()
    counts = _one(full, MixtureCounts).counts()
    timestamp = {u: int(getattr(full.state.timestamp, u)) for u in COUNTER_UNITS}
    # a change at every eval (every 5 batches) but the last (the run's end): the weights moved
    assert [c["position"] for c in history] == list(range(40, 320, 40))
    assert history[-1]["new"] != history[0]["old"]
    assert all(c["old"] == p["new"] for p, c in zip(history, history[1:]))
    # the run trained the switched order: its rows are the final mixture's plan, row for row
    plan = full_loader.mixture.plan(seed=3, total_samples=320, global_batch=8)
    assert [(e, s, r) for e, s, r in full_seen.rows] == [(e, s, r) for e in (0, 1) for s, r in plan.rows(e, 0, 160)]
    trained = Counter(MIXTURE.names[s] for _, s, _ in full_seen.rows)
    assert {n: c["samples"] for n, c in counts.items()} == dict(trained)
    fixed = MIXTURE.plan(seed=3, total_samples=320).consumed(1, 160)
    assert tuple(trained[n] for n in MIXTURE.names) != fixed  # the counts are not the fixed mixture's

    run = str(tmp_path / "run")
    folder = run + "/checkpoints"  # a local run's directory: the report reads its checkpoints
    crashed, crashed_seen, _ = make(folder, crash_at=17)  # newest checkpoint: batch 14, after 2 changes
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    resumed, resumed_seen, _ = make(folder)
    assert resumed.state.step == 14
    resumed.fit()
    assert _one(resumed, OnlineMixture).changes() == history
    assert _one(resumed, MixtureCounts).counts() == counts
    assert {u: int(getattr(resumed.state.timestamp, u)) for u in COUNTER_UNITS} == timestamp
    assert crashed_seen.rows[: 14 * 8] + resumed_seen.rows == full_seen.rows

    # the checkpoint's ledger answers over the history it saved (batch 14: epoch 0, position 112)
    ledger = ledger_of_checkpoint(_saved_state(folder, batch=14))
    before = Counter((s, r) for _, s, r in full_seen.rows[: 14 * 8])
    for i, name in enumerate(MIXTURE.names):
        for row in range(SOURCES[name]):
            assert ledger.ask(name, row).times == before[(i, row)]

    # the run report plots the weights over time from the newest checkpoint's history (the run's end: all of it)
    written = write_report(run)
    assert any(image.endswith("mixture_weights.png") for image in written["images"])
    check_png(os.path.join(run, "mixture_weights.png"))
    with open(os.path.join(run, "report.html")) as fh:
        section = fh.read().split("<h2>Mixture weights over time (online policy)</h2>", 1)[1].split("<h2>", 1)[0]
    assert section.count("<tr>") == 1 + len(history) and f"{history[-1]['new']['math']:.3f}" in section


def _saved_state(folder, batch):
    """The checkpoint's saved state at ``batch``, read as the ledger CLI reads it."""
    from raytrain_events.checkpoint.folder.store import list_checkpoints
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files
    from raytrain_events.storage.run_dir import STATE_FILE

    (info,) = [c for c in list_checkpoints(folder) if c.batch == batch]
    return read_checkpoint_files(info, files=[STATE_FILE]).files[STATE_FILE]


def test_an_online_mixture_without_its_evaluators_is_refused_before_training():
    trainer, seen, _ = make(labels={"web": "held_out_web"})
    with pytest.raises(MixtureError, match=r"no evaluator is labelled \['web'\].*online=\{'evaluators'"):
        trainer.fit()
    assert seen.rows == []


TARGET_MIXTURE = Mixture(
    sources=SOURCES,
    weights={"web": 1, "code": 1, "math": 1},
    epoch_size=160,
    online={"policy": "target", "target": "task", "rate": 2.0},
)


def task_evaluator():
    """The held-out task the run is for: 32 rows labelled by code's rule, 8 by math's, none by web's."""
    rows = [Rows(0, 32, offset=900)[j] for j in range(32)] + [Rows(1, 8, offset=900)[j] for j in range(8)]
    return Evaluator(label="task", dataloader=torch.utils.data.DataLoader(rows, batch_size=20), eval_interval="5ba")


def test_the_target_policy_trains_toward_the_tasks_sources_and_resumes_exactly(tmp_path):
    """The policy 'target' reads the task's own eval loss beside the sources' and moves the weights toward the
    sources the task is made of; a crash resumed from a checkpoint replays the history (the target's losses kept in
    it) and ends with the same weights, counts, rows and Timestamp."""
    full, full_seen, _ = make(mixture=TARGET_MIXTURE, extra=[task_evaluator()])
    full.fit()
    history = _one(full, OnlineMixture).changes()
    assert [c["position"] for c in history] == list(range(40, 320, 40)) and all("target" in c for c in history)
    final = history[-1]["new"]
    assert final["code"] > 0.5 and final["code"] > final["math"] and final["code"] > final["web"]
    folder = str(tmp_path / "checkpoints")
    crashed, crashed_seen, _ = make(folder, crash_at=17, mixture=TARGET_MIXTURE, extra=[task_evaluator()])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    resumed, resumed_seen, _ = make(folder, mixture=TARGET_MIXTURE, extra=[task_evaluator()])
    assert resumed.state.step == 14
    resumed.fit()
    assert _one(resumed, OnlineMixture).changes() == history
    assert _one(resumed, MixtureCounts).counts() == _one(full, MixtureCounts).counts()
    assert {u: int(getattr(resumed.state.timestamp, u)) for u in COUNTER_UNITS} == {
        u: int(getattr(full.state.timestamp, u)) for u in COUNTER_UNITS
    }
    assert crashed_seen.rows[: 14 * 8] + resumed_seen.rows == full_seen.rows
    # without the task's evaluator: refused before a batch trains
    trainer, seen, _ = make(mixture=TARGET_MIXTURE)
    with pytest.raises(MixtureError, match=r"online policy 'target'.*no evaluator is labelled 'task'.*label='task'"):
        trainer.fit()
    assert seen.rows == []
