"""Population-based training over algorithm sets: ONE run of ``examples/tune_pbt.py``, checked twice.

The example and the PBT machinery used to be tested by two sweeps of the same path (a subprocess
of the example, then a second sweep of the same shape in this file), each 2-4 minutes. Now one
module-scoped run drives the example's own ``main()`` (its argument parsing, data, model, sweep,
report and printed summary) on the session's Ray, with three test-only instruments:

* ``FitStarts``: rank 0 records the Timestamp counters each fit starts at, so a copied run can
  be shown to start at the donor checkpoint's exact global Timestamp;
* ``StartTogether``: the population's first fits wait for each other, so asynchronous PBT can
  compare them on a loaded machine (it changes nothing else);
* ``resample_probability=0.0`` (the example uses 0.25): every exploration moves to a neighbouring
  set and lr, so a copy of a trial running ``[]`` (the middle of ``ALGORITHM_SETS[:3]``) always
  switches algorithm set and the check for that cannot miss by chance.

Three trials on ``[]``, two that cannot learn (lr 0) and one that does (lr 0.05), for 3 epochs,
a perturbation every epoch of global samples. The embedded-Ray start of an example (`ensure_ray`
with no Ray running) is covered by the shared ``examples/train.py`` run (tests/examples/conftest.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time
import uuid

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from tests.example_scripts import load_example

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_TRAIN = int(0.8 * 1797)  # the example's 80/20 split of the digits
EPOCHS, LRS = 3, (0.0, 0.05, 0.0)


class FitStarts(Callback):
    """Rank 0 writes the Timestamp counters each run starts at (a copied run starts at the donor's)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        if state.rank == 0:
            counters = {u: state.timestamp.get_value(u) for u in ("ep", "ba", "sp", "tok")}
            with open(os.path.join(self.folder, f"start-{uuid.uuid4().hex[:8]}.json"), "w") as f:
                json.dump(counters, f)


class StartTogether(Callback):
    """The population's first fits wait for each other (rank 0, files in a shared folder, 120 s at most).

    Asynchronous PBT ranks a trial only against trials that have reported, so a trial whose worker
    group started seconds before the others (Ray Train start-up varies a lot on a loaded machine)
    could reach every perturbation point alone and never be compared. Later fits (copies) pass.
    """

    def __init__(self, folder: str, population: int) -> None:
        self.folder, self.population = folder, population

    def fit_start(self, state, logger) -> None:
        if state.rank != 0:
            return
        with open(os.path.join(self.folder, f"started-{uuid.uuid4().hex[:8]}"), "w"):
            pass
        deadline = time.time() + 120
        while len(os.listdir(self.folder)) < self.population and time.time() < deadline:
            time.sleep(0.2)


def _load_example():
    """``examples/tune_pbt.py`` as a module (its ``main()`` is what ``python examples/tune_pbt.py`` runs)."""
    return load_example("tune_pbt.py", "tune_pbt_example")


@pytest.fixture(scope="module")
def pbt_run(ray_cluster, tmp_path_factory):
    """The example's ``main()`` once, instrumented as the module docstring says.

    Yields a dict: ``out`` (what it printed), ``result`` (the `sweep` result), ``fit_starts``
    (counters each fit started at), ``sweep_dir``, ``example`` (the module).
    """
    tmp = tmp_path_factory.mktemp("pbt")
    starts, barrier = tmp / "starts", tmp / "barrier"
    starts.mkdir()
    barrier.mkdir()
    captured = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "path", list(sys.path))  # the example puts examples/ first on the path
        example = _load_example()
        real_sweep, real_pbt = example.sweep, example.pbt_scheduler

        def sweep(*, trainer, **kwargs):
            assert "callbacks" not in trainer, "the example now has callbacks of its own: add these to them"
            callbacks = [FitStarts(str(starts)), StartTogether(str(barrier), len(LRS))]
            captured["result"] = real_sweep(trainer={**trainer, "callbacks": lambda config: callbacks}, **kwargs)
            return captured["result"]

        mp.setattr(example, "sweep", sweep)
        mp.setattr(example, "pbt_scheduler", lambda *a, **kw: real_pbt(*a, **{**kw, "resample_probability": 0.0}))
        mp.setattr(
            sys,
            "argv",
            [
                "tune_pbt.py",
                *("--storage", str(tmp / "sweeps"), "--name", "pbt"),
                *("--sets", "1", "--lr", *map(str, LRS), "--epochs", str(EPOCHS)),
            ],
        )
        mp.chdir(tmp)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            example.main()
    out = printed.getvalue()
    print(out)
    fit_starts = [json.load(open(starts / n)) for n in os.listdir(starts)]
    yield {
        "out": out,
        "result": captured["result"],
        "fit_starts": fit_starts,
        "sweep_dir": tmp / "sweeps" / "pbt",
        "example": example,
    }


def test_tune_pbt_example_copies_the_good_trial_into_the_bad_ones(pbt_run):
    """What a user of the example sees: copies printed, lineage on disk at epoch boundaries, a report."""
    out, sweep_dir = pbt_run["out"], pbt_run["sweep_dir"]
    copies = int(re.search(r"copies:\s+(\d+)", out).group(1))
    assert copies >= 1, out[-4000:]
    paths = sorted(sweep_dir.glob("*/raytrain_trial.json"))
    records = [json.load(open(p)) for p in paths]
    for path, record in zip(paths, records):  # a copy loads another trial's checkpoint
        assert all(step["copied_trial"] != path.parent.name for step in record.get("lineage") or [])
    assert len(records) == 3
    steps = [step for record in records for step in record.get("lineage") or []]
    assert len(steps) == copies
    # Every Train run is a trial's first or a copy: the population runs at once, so PBT paused no trial to make
    # room (a pause ended its run and restarted it from its own checkpoint: `EndAwarePBT.trials_at_once`).
    assert len(pbt_run["fit_starts"]) == len(LRS) + copies, pbt_run["fit_starts"]
    tune_results = {row["path"].rstrip("/").rsplit("/", 1)[-1]: pbt_run["result"].histories[row["trial_id"]]
                    for row in pbt_run["result"].rows}  # fmt: skip
    for step in steps:
        # Copies happen at epoch boundaries of global samples, of the checkpoint the donor reported to Tune
        # with that point's result (PBT copies the checkpoint of the result it acted on: a result without one,
        # and the checkpoint in a later result of its own, made it skip the copy or take an older checkpoint).
        sample = step["counters"]["sample"]
        donor = tune_results[step["copied_trial"]]
        assert any(
            e.get("checkpoint_path") and "metrics/eval/accuracy" in e for e in donor if e.get("time/sample") == sample
        )
        boundary = sample - sample % N_TRAIN  # a save postponed by slow storage goes (with its report) a batch later
        assert boundary > 0 and (sample == boundary or not any(e.get("time/sample") == boundary for e in donor))
        assert step["counters"]["epoch"] == sample // N_TRAIN
    for results in tune_results.values():  # no result at an epoch's end without the checkpoint saved there
        ends = [e for e in results if e.get("time/sample", 0) > 0 and e["time/sample"] % N_TRAIN == 0]
        assert all(e.get("checkpoint_path") for e in ends if not e.get("final")), ends
    # Every trial ends at the full duration, and the population learned: its best is far above chance.
    assert all(record["history"][-1]["time/sample"] == EPOCHS * N_TRAIN for record in records)
    best = float(re.search(r"best metrics/eval/accuracy: ([0-9.]+)", out).group(1))
    assert best > 0.8, out[-4000:]
    html = (sweep_dir / "report.html").read_text()
    assert "Lineage (population-based training)" in html


def test_pbt_copies_the_good_trial_into_the_bad_ones(pbt_run):
    """The copy itself: a changed set, the donor's exact Timestamp, its own explored lr, a better population.

    Every trial completes although PBT paused trials (their Train workers are released: before,
    paused trials kept their CPUs and later worker groups never started).
    """
    result, fit_starts, example = pbt_run["result"], pbt_run["fit_starts"], pbt_run["example"]
    sets, lrs_allowed = example.ALGORITHM_SETS, example.LEARNING_RATES
    assert [row["status"] for row in result.rows] == ["completed"] * 3, result.to_table()
    copied = [row for row in result.rows if row["lineage"]]
    assert copied, result.to_table()  # at least one exploit
    assert "copied" in result.to_table()
    steps = [step for row in copied for step in row["lineage"]]
    assert any(step["algorithms"] != step["from_algorithms"] for step in steps), steps  # a changed set
    for row in copied:
        for step in row["lineage"]:
            assert step["copied_trial"] != os.path.basename(row["path"].rstrip("/"))
            assert step["algorithms"] in sets
            donor_counters = step["counters"]
            assert donor_counters["sample"] > 0
            # The copied run started at the donor checkpoint's exact global Timestamp.
            expected = {
                "ep": donor_counters["epoch"],
                "ba": donor_counters["batch"],
                "sp": donor_counters["sample"],
                "tok": donor_counters["token"],
            }
            assert expected in fit_starts, (expected, fit_starts)
        # The donor's lr, moved to a neighbour in the example's list (which has no 0): never the lr=0 it had.
        assert row["config"]["lr"] in lrs_allowed, row["config"]
        # The copied run trains with its own explored lr, not the one in the donor's optimizer state.
        lrs = [e["train/lr"] for e in result.histories[row["trial_id"]] if "train/lr" in e]
        assert lrs[-1] == pytest.approx(row["config"]["lr"]), (lrs, row["config"])
        assert row["run_url"].rstrip("/").endswith(row["lineage"][-1]["run_name"])
    # The same budget of independent trials: the lr=0 trials would end at their untrained loss
    # (their results before any copy), the good one at its own end.
    # (The sweep ranks on eval accuracy, so a row's train/loss is its history's last.)
    losses = {
        row["trial_id"]: [e for e in result.histories[row["trial_id"]] if "train/loss" in e] for row in result.rows
    }
    final = {trial_id: entries[-1]["train/loss"] for trial_id, entries in losses.items()}
    independent = []
    for row in result.rows:
        entries = losses[row["trial_id"]]
        if row["lineage"]:
            first = row["lineage"][0]["counters"]["sample"]
            before = [e["train/loss"] for e in entries if e["time/sample"] <= first]
            independent.append(before[0] if before else max(final.values()))
        else:
            independent.append(final[row["trial_id"]])
    population = sorted(final.values())
    # Strictly better: a copy that trains at least one batch with a working lr ends below the lr=0
    # loss it would have kept. How much better depends on when the copy came (one or two epochs in).
    assert sum(population) / 3 < sum(independent) / 3, (population, independent)
