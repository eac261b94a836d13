"""The token ledger (`raytrain_events.core.ledger`): the inverse permutation, and every answer checked
against the rows a real `Trainer` run over a `Mixture` trained (with a rollback skipping windows and
a source read more than once per epoch), at several checkpoints."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from raytrain_events import Callback, Trainer
from raytrain_events.callbacks import SpikeGuard
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.ledger import Ledger, ledger_of_checkpoint
from raytrain_events.core.mixture import Mixture
from raytrain_events.core.mixture_plan import inverse_permute, permute
from raytrain_events.core.spikes import SkipList, SkipRange
from raytrain_events.data.mixture_loader import MixtureLoader

SOURCES = {"web": 100, "code": 60, "math": 10}  # math: 32 reads from 10 rows per epoch (3+ passes)
MIXTURE = Mixture(sources=SOURCES, stages={"0dur": {"web": 0.5, "code": 0.3, "math": 0.2}}, epoch_size=160)
POISON = ("web", 7)
BATCH = 8


@pytest.mark.parametrize("size", [1, 2, 3, 10, 64, 100, 1000, 2049])
def test_inverse_permute_undoes_permute(size):
    for key in (0, 7, 2**63 + 5):
        assert [inverse_permute(permute(i, size, key), size, key) for i in range(size)] == list(range(size))


class Rows:
    def __init__(self, source: int, name: str, rows: int):
        self.source, self.name, self.rows = source, name, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, row):
        g = torch.Generator().manual_seed(self.source * 1000 + row)
        x = torch.randn(4, generator=g)
        y = int(x[0] > 0)
        if (self.name, row) == POISON:  # a huge input with the wrong label
            x, y = x * 1e4, 1 - y
        return {"x": x, "y": torch.tensor(y), "id": torch.tensor([self.source, row])}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, batch):
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch["y"])


class Positions(Callback):
    """``{(epoch, end position): [(source, row), ...]}`` of every trained batch (rolled-back ones included)."""

    def __init__(self):
        self.batches = {}

    def batch_end(self, state, logger):
        key = (int(state.timestamp.epoch), int(state.timestamp.sample_in_epoch))
        self.batches[key] = [tuple(map(int, i)) for i in state.batch["id"]]


def test_the_ledger_matches_the_rows_a_mixture_run_trained():
    datasets = {name: Rows(i, name, rows) for i, (name, rows) in enumerate(SOURCES.items())}
    loader = MixtureLoader(MIXTURE, datasets, batch_size=BATCH)
    guard, positions = SpikeGuard(snapshot_interval=3, warmup=3), Positions()
    model = Tiny()
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader),
        max_duration="3ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[positions, guard],
        seed=5,
    )
    trainer.fit()
    assert len(guard.rollbacks) >= 2  # the poisoned row spikes in (nearly) every epoch
    names = list(SOURCES)
    # Checkpoints: every few batches of the run, and its end.
    ends = [(e, p) for e in range(3) for p in range(16, 161, 24)] + [(3, 0)]
    for epoch, position in ends:
        trained = Counter(
            (names[s], r)
            for (e, end), rows in positions.batches.items()
            if (e < epoch or (e == epoch and end <= position)) and not guard.skips.contains(e, end - 1)
            for s, r in rows
        )
        ledger = Ledger(plan=loader.plan, epoch=epoch, position=position, skips=guard.skips)
        for name, rows in SOURCES.items():
            answers = {r: ledger.ask(name, r).times for r in range(rows)}
            assert answers == {r: trained[(name, r)] for r in range(rows)}, (epoch, position, name)
    final_ledger = Ledger(plan=loader.plan, epoch=3, position=0, skips=guard.skips)
    final = final_ledger.ask(*POISON)
    assert final.times + len(final.skipped) == 3 and final.skipped
    # What a checkpoint saves is enough (the CLI's path): the same answers from the saved state alone.
    saved = ledger_of_checkpoint(trainer.state.state_dict())
    assert saved.skips == guard.skips and (saved.epoch, saved.position) == (3, 0)
    for name, rows in SOURCES.items():
        assert [saved.ask(name, r) for r in range(rows)] == [final_ledger.ask(name, r) for r in range(rows)]
    # The per-source counts (MixtureCounts, restored with each snapshot) are the trained rows, as the ledger says.
    counts = next(c for c in trainer.state.callbacks if type(c).__name__ == "MixtureCounts").counts()
    assert {n: counts[n]["samples"] for n in SOURCES} == {
        n: sum(final_ledger.ask(n, r).times for r in range(rows)) for n, rows in SOURCES.items()
    }
    # State.skipped: the positions not trained, apart from the Timestamp, per source as the ledger counts them.
    skipped = {n: sum(len(final_ledger.ask(n, r).skipped) for r in range(rows)) for n, rows in SOURCES.items()}
    assert trainer.state.skipped.by_source == {n: k for n, k in skipped.items() if k}
    assert trainer.state.skipped.samples == sum(skipped.values()) == guard.skips.totals()[1]
    assert guard.trained(trainer.state)["sample"] == int(trainer.state.timestamp.sample) - sum(skipped.values())
    trainer.fit(duration="1ep")  # a rollback is not a resume: the next fit of the same Trainer goes on
    assert int(trainer.state.timestamp.epoch) == 4


def test_a_plain_unshuffled_run_and_bad_questions():
    skips = SkipList([SkipRange(0, 200, 216, 2)])
    ledger = Ledger.plain(400, epoch=1, position=100, skips=skips)
    assert ledger.ask("train", 203).times == 0 and ledger.ask("train", 203).skipped == (0,)
    assert ledger.ask("train", 50).epochs == (0, 1)
    assert ledger.ask("train", 150).times == 1
    assert "trained 2 times" in ledger.ask("train", 50).line()
    with pytest.raises(ValueError, match="outside the dataset's 400 rows"):
        ledger.ask("train", 400)
    with pytest.raises(ValueError, match="No source 'web'"):
        ledger.ask("web", 1)
    with pytest.raises(ValueError, match="block sizes"):
        Ledger.plain(400, epoch=0, position=0, shuffled=True)
    mixture_ledger = Ledger(plan=MIXTURE.plan(seed=0), epoch=0, position=0)
    with pytest.raises(ValueError, match="No source .books.*code, math, web"):
        mixture_ledger.ask("books", 0)
