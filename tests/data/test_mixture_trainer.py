"""A `Mixture` through the local `Trainer`: stages, per-source counts and exact resumes (mid-stage and across a stage)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.time import COUNTER_UNITS
from raytrain_events.data.mixture_counts import MixtureCounts, MixtureResumeError
from raytrain_events.data.mixture_loader import MixtureLoader

SOURCES = {"web": 100, "code": 60, "math": 80}
# 160 samples per epoch, 2 epochs: the second stage starts at sample 192 (epoch 1, sample 32: the 5th batch of 8).
MIXTURE = Mixture(
    sources=SOURCES,
    stages={"0dur": {"web": 0.6, "code": 0.3, "math": 0.1}, "0.6dur": {"web": 0.2, "code": 0.3, "math": 0.5}},
    epoch_size=160,
)
STEPS_PER_EPOCH, STAGE_STEP = 20, 24


class Rows:
    """A map-style source whose rows say where they come from; it records every row read."""

    def __init__(self, source: int, rows: int, log: list, feature: str = "x"):
        self.source, self.rows, self.log, self.feature = source, rows, log, feature

    def __len__(self):
        return self.rows

    def __getitem__(self, row):
        self.log.append((self.source, row))
        g = torch.Generator().manual_seed(self.source * 1000 + row)
        x = torch.randn(4, generator=g)
        return {
            self.feature: x,
            "y": torch.tensor(int(x[0] > 0)),
            "id": torch.tensor([self.source, row]),
            "len": torch.tensor(1 + (row * 7 + self.source) % 5),
        }


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, batch):
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch["y"])


class Seen(Callback):
    """The (epoch, source, row) of every trained sample; optionally crashes after a step."""

    def __init__(self, crash_at=None):
        self.rows, self.crash_at = [], crash_at

    def after_dataloader(self, state, logger):
        self.rows.extend((state.epoch, *map(int, i)) for i in state.batch["id"])

    def batch_end(self, state, logger):
        if state.step == self.crash_at:
            raise RuntimeError("simulated crash")


def make(folder=None, crash_at=None, log=None, mixture=MIXTURE, seed=7):
    log = [] if log is None else log
    datasets = {name: Rows(i, rows, log) for i, (name, rows) in enumerate(SOURCES.items())}
    loader = MixtureLoader(mixture, datasets, batch_size=8, tokens_of_row=lambda row: int(row["len"]))
    del log[:]  # the schema check read row 0 of each source
    seen = Seen(crash_at)
    model = Tiny()
    checkpoint = None
    if folder is not None:
        checkpoint = CheckpointConfig(save_folder=folder, save_interval="5ba", autoresume=True, async_save=False)
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[seen],
        checkpoint=checkpoint,
        seed=seed,
    )
    return trainer, seen, log


def counters(trainer):
    ts = trainer.state.timestamp
    return {unit: int(getattr(ts, unit)) for unit in COUNTER_UNITS}


def mixture_counts(trainer):
    (callback,) = [c for c in trainer.state.callbacks if isinstance(c, MixtureCounts)]
    return callback.counts()


def test_mixture_resumes_mid_stage_and_across_a_stage_boundary_exactly(tmp_path):
    """A 3-source mixture with a stage change, crashed and resumed twice, ends as the uninterrupted run."""
    full, full_seen, full_log = make()
    full.fit()
    expected, expected_counts = counters(full), mixture_counts(full)
    assert expected["epoch"] == 2 and expected["sample"] == 320
    # tokens seen per source add up to the Timestamp's, samples to its samples
    assert sum(c["tokens"] for c in expected_counts.values()) == expected["token"]
    assert sum(c["samples"] for c in expected_counts.values()) == expected["sample"]
    # every chosen row once per epoch, and each stage's proportions per epoch
    for epoch in (0, 1):
        rows = [(s, r) for e, s, r in full_seen.rows if e == epoch]
        assert len(rows) == 160 and len(set(rows)) == 160
    first = Counter(s for e, s, _ in full_seen.rows if e == 0)
    assert first == {0: 96, 1: 48, 2: 16}
    stage_two = Counter(s for _, s, _ in full_seen.rows[192:])
    assert stage_two == {0: 26, 1: 38, 2: 64}
    metrics = full.logger.metrics
    assert metrics["mixture/tokens/math"] == expected_counts["math"]["tokens"]

    folder = str(tmp_path / "checkpoints")  # a checkpoint every 5 batches
    # 1) crash mid-stage in epoch 0, after step 12: the newest checkpoint is step 10's
    first_run, _, _ = make(folder, crash_at=12)
    with pytest.raises(RuntimeError, match="simulated crash"):
        first_run.fit()
    # 2) resume at step 10, train across the epoch and the stage boundary (step 24), crash after step 27
    second, second_seen, second_log = make(folder, crash_at=27)
    assert second.state.step == 10 and int(second.state.timestamp.sample_in_epoch) == 80
    with pytest.raises(RuntimeError, match="simulated crash"):
        second.fit()
    assert second_seen.rows == full_seen.rows[10 * 8 : 27 * 8]
    # nothing before the resume position was read: the reads are exactly the uninterrupted run's from there
    assert second_log == full_log[10 * 8 : 27 * 8]
    # 3) resume at step 25, in the second stage (epoch 1, sample 40), to the end
    last, last_seen, last_log = make(folder)
    assert last.state.step == STAGE_STEP + 1 and int(last.state.timestamp.sample_in_epoch) == 40
    last.fit()
    assert last_seen.rows == full_seen.rows[25 * 8 :]
    assert last_log == full_log[25 * 8 :]
    assert counters(last) == expected
    assert mixture_counts(last) == expected_counts
    assert [p.tolist() for p in last.state.model.parameters()] == [p.tolist() for p in full.state.model.parameters()]


def test_resume_with_another_mixture_or_seed_is_refused(tmp_path):
    folder = str(tmp_path / "checkpoints")
    crashed, _, _ = make(folder, crash_at=7)  # newest checkpoint: step 5
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    other = Mixture(sources=SOURCES, weights={"web": 1, "code": 1, "math": 1}, epoch_size=160)
    with pytest.raises(MixtureResumeError, match=r"another mixture.*resume with the checkpoint's mixture"):
        make(folder, mixture=other)
    reseeded, _, _ = make(folder, seed=8)
    with pytest.raises(
        MixtureResumeError, match=r"has seed 7 .* this run's has seed 8 .*resume with the checkpoint's seed"
    ):
        reseeded.fit()


def test_sources_with_another_schema_or_row_count_are_refused_when_opened():
    log = []
    datasets = {name: Rows(i, rows, log) for i, (name, rows) in enumerate(SOURCES.items())}
    datasets["math"] = Rows(2, 80, log, feature="features")
    with pytest.raises(MixtureError, match=r"Source 'math' has another schema than 'code'.*convert it first"):
        MixtureLoader(MIXTURE, datasets, batch_size=8)
    datasets["math"] = Rows(2, 79, log)
    with pytest.raises(MixtureError, match=r"'math' has 79 rows but the mixture says 80"):
        MixtureLoader(MIXTURE, datasets, batch_size=8)
    datasets.pop("math")
    with pytest.raises(MixtureError, match=r"one dataset per source"):
        MixtureLoader(MIXTURE, datasets, batch_size=8)


def test_tokens_per_source_are_counted_only_where_the_loader_counts_tokens():
    """Each count is a value on the loop's per-batch sum: without tokens_of_row only samples are summed."""
    datasets = {name: Rows(i, rows, []) for i, (name, rows) in enumerate(SOURCES.items())}
    model = Tiny()
    trainer = Trainer(
        model=model,
        train_dataloader=MixtureLoader(MIXTURE, datasets, batch_size=8),
        max_duration="3ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    assert [n for n in trainer.state.agreement.names if n.startswith("mixture/")] == [
        "mixture/samples/code",
        "mixture/samples/math",
        "mixture/samples/web",
    ]
    trainer.fit()
    counts = mixture_counts(trainer)
    assert sum(c["samples"] for c in counts.values()) == 24 and all(c["tokens"] == 0 for c in counts.values())


def test_a_stage_the_run_cannot_place_is_refused_when_the_trainer_is_built():
    datasets = {name: Rows(i, rows, []) for i, (name, rows) in enumerate(SOURCES.items())}
    loader = MixtureLoader(MIXTURE, datasets, batch_size=8, tokens_of_row=lambda row: int(row["len"]))
    model = Tiny()
    with pytest.raises(ValueError, match=r"'0.6dur' is a fraction of the run.*give max_duration in 'ep', 'sp' or 'ba'"):
        Trainer(
            model=model,
            train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch),
            max_duration="5000tok",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        )


def test_a_resume_may_switch_the_weights_from_the_checkpoint_on(tmp_path):
    """A PBT exploit's case: a run continued from a checkpoint (step 30, sample 240) with new weights from
    there (`Mixture.switched`): every source continues from its cursor, the new stage holds the rest."""
    full, full_seen, _ = make()
    full.fit()
    at_full = Counter(s for _, s, _ in full_seen.rows[:240])
    folder = str(tmp_path / "checkpoints")
    crashed, _, _ = make(folder, crash_at=32)  # newest checkpoint: step 30 = sample 240 (epoch 1, sample 80)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    early, _, _ = make(folder, mixture=MIXTURE.switched(200, {"math": 1}))  # before the checkpoint: refused
    with pytest.raises(MixtureResumeError, match="resume with the checkpoint's seed"):
        early.fit()
    switched = MIXTURE.switched(240, {"math": 1})
    assert Mixture.from_dict(switched.to_dict()) == switched and switched.continues(MIXTURE)
    run, seen, log = make(folder, mixture=switched)
    assert run.state.step == 30
    run.fit()
    assert counters(run)["sample"] == 320 and [s for _, s, _ in seen.rows] == [2] * 80  # only math from 240 on
    # math continues from its cursor: the rows after it in its order, none trained twice in the epoch
    epoch_one = [(s, r) for e, s, r in full_seen.rows[160:240]] + [(s, r) for _, s, r in seen.rows]
    math_rows = [r for s, r in epoch_one if s == 2]
    # math's 80 rows once each, then (asked for more) a second pass, again with no row twice
    assert len(math_rows) > 80 and sorted(math_rows[:80]) == list(range(80))
    assert len(set(math_rows[80:])) == len(math_rows) - 80
    counts = mixture_counts(run)
    assert counts["math"]["samples"] == at_full[2] + 80 and counts["web"]["samples"] == at_full[0]
    assert log == [(s, r) for _, s, r in seen.rows]  # read: only the rows trained after the checkpoint
