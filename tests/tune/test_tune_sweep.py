"""`raytrain_events.tune.sweep` on the real local Ray: algorithm-set grids, ASHA on samples, aggregated metrics."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time

import pytest
import torch
from ray import cloudpickle as ray_cloudpickle
from tune_helpers import (
    ROWS,
    SETS,
    LossDump,
    datasets,
    datasets_with_val,
    make_model,
    make_sgd,
    marker_callbacks,
    markers,
    trial_tag,
    wait_until,
)

from raytrain_events import Callback
from raytrain_events.tune import algorithm_set_label, algorithm_sets_grid, sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's lambdas to workers


def _trainer(marker_folder, **kw):
    base = dict(
        model=make_model,
        optimizers=make_sgd,
        datasets=datasets,
        max_duration="2ep",
        batch_size=32,
        num_workers=1,
        report_interval="4ba",
        report_every_s=None,  # reports by batches only: a loaded machine's timed reports would add entries
        callbacks=marker_callbacks(marker_folder),
    )
    base.update(kw)
    return base


# -- argument checks (no trials run) ----------------------------------------------------------


def test_algorithm_sets_grid_validates_and_labels():
    grid = algorithm_sets_grid([[], "label_smoothing", [{"name": "mixup", "alpha": 0.4}, "label_smoothing"]])
    assert grid == {"grid_search": [[], ["label_smoothing"], [{"name": "mixup", "alpha": 0.4}, "label_smoothing"]]}
    assert [algorithm_set_label(s) for s in grid["grid_search"]] == [
        "none",
        "label_smoothing",
        "mixup(alpha=0.4)+label_smoothing",
    ]
    with pytest.raises(ValueError, match="Unknown algorithm 'label_smothing'.*label_smoothing"):
        algorithm_sets_grid([["label_smothing"]])
    with pytest.raises(TypeError, match="mixup"):
        algorithm_sets_grid([[{"name": "mixup", "beta": 1.0}]])
    with pytest.raises(ValueError, match="more than once"):
        algorithm_sets_grid([["mixup"], "mixup"])


def test_sweep_rejects_bad_arguments_before_any_trial(tmp_path):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    trainer = _trainer(str(tmp_path))
    with pytest.raises(ValueError, match="mode"):
        sweep(trainer=trainer, metric="train/loss", mode="best", storage_path=str(tmp_path))
    with pytest.raises(ValueError, match="storage_path.*set by the sweep"):
        sweep(trainer={**trainer, "storage_path": "x"}, metric="train/loss", mode="min")
    with pytest.raises(TypeError, match="not a RayTrainer argument"):
        sweep(trainer={**trainer, "learning_rate": 0.1}, metric="train/loss", mode="min")
    with pytest.raises(ValueError, match="Unknown algorithm"):
        sweep(trainer=trainer, param_space={"algorithms": tune.choice([["nope"]])}, metric="train/loss", mode="min")
    with pytest.raises(ValueError, match="time/samples"):
        sweep(trainer=trainer, metric="train/loss", mode="min", scheduler=ASHAScheduler(time_attr="time/samples"))
    with pytest.raises(ValueError, match="get_num_tokens_in_batch"):
        sweep(trainer=trainer, metric="train/loss", mode="min", scheduler=ASHAScheduler(time_attr="time/token"))


def test_trial_config_is_merged_into_the_base_spec():
    from raytrain_events.ray.spec import RunSpec
    from raytrain_events.tune.trial import trial_spec as _trial_spec

    base = RunSpec(
        model=make_model,
        optimizers=make_sgd,
        datasets=lambda config: {"train": config.get("rows")},
        max_duration="2ep",
        algorithms=["ema"],
        config={"lr": 0.1, "hidden": 8},
    )
    spec = _trial_spec(
        base,
        {
            "algorithms": ["label_smoothing"],
            "lr": 0.5,
            "rows": "R",
            "trainer": {"batch_size": 7, "max_duration": "3ep"},
        },
    )
    assert spec.algorithms == ["label_smoothing"]  # the trial's set replaces the base set
    assert spec.config["lr"] == 0.5 and spec.config["hidden"] == 8
    assert spec.config["algorithms"] == ["label_smoothing"]
    assert spec.data.batch_size == 7 and spec.max_duration == "3ep"
    assert spec.build_datasets() == {"train": "R"}  # a datasets factory is called with the trial config
    assert base.algorithms == ["ema"] and base.data.batch_size == 64 and base.config == {"lr": 0.1, "hidden": 8}
    assert _trial_spec(base, {"lr": 0.3}).algorithms == ["ema"]  # no "algorithms" key: the base set
    with pytest.raises(ValueError, match="set by the sweep"):
        _trial_spec(base, {"trainer": {"run_name": "x"}})
    with pytest.raises(TypeError, match="'lr_max'.*not a RayTrainer argument"):
        _trial_spec(base, {"trainer": {"lr_max": 1}})
    with pytest.raises(ValueError, match="batch_size=0"):  # overrides are validated like a new spec
        _trial_spec(base, {"trainer": {"batch_size": 0}})


def test_best_checkpoint_is_the_best_reported_one():
    from raytrain_events.tune.results import _best_checkpoint

    history = [
        {"time/batch": 4, "train/loss": 0.9},
        {"time/batch": 8, "metrics/eval/accuracy": 0.7, "checkpoint_path": "/c/ep1"},
        {"time/batch": 16, "metrics/eval/accuracy": 0.9, "checkpoint_path": "/c/ep2"},
        {"time/batch": 24, "metrics/eval/accuracy": 0.8, "checkpoint_path": "/c/ep3"},
        {"time/batch": 24, "final": True},
    ]
    assert _best_checkpoint(history, "metrics/eval/accuracy", "max", "/nowhere", {}) == "/c/ep2"
    assert _best_checkpoint(history, "metrics/eval/accuracy", "min", "/nowhere", {}) == "/c/ep1"
    assert _best_checkpoint(history, "train/loss", "min", "/nowhere", {}) == "/c/ep3"  # no metric on them: newest
    assert _best_checkpoint(history[:1], "train/loss", "min", "/nowhere", {}) is None


def test_async_validations_count_at_their_checkpoints_timestamp():
    """Validation entries arrive late; the trial's metric and its best checkpoint read them at their checkpoint."""
    from raytrain_events.ray.checkpointing.validation import in_training_order
    from raytrain_events.tune.results import _best_checkpoint

    history = [
        {"time/sample": 64, "checkpoint_path": "/c/ep1"},
        {"time/sample": 128, "checkpoint_path": "/c/ep2"},
        {"time/sample": 64, "validation": "async", "validated_checkpoint": "ep1", "metrics/val/loss": 0.5},
        {"time/sample": 192, "checkpoint_path": "/c/ep3", "final": True},
        {"time/sample": 192, "validation": "async", "validated_checkpoint": "ep3", "metrics/val/loss": 0.7},
        {"time/sample": 128, "validation": "async", "validated_checkpoint": "ep2", "metrics/val/loss": 0.4},
        {"time/sample": 256, "validation": "failed", "validated_checkpoint": "gone", "validation_error": "x"},
    ]
    ordered = in_training_order(history)
    assert [e.get("checkpoint_path") or e["validated_checkpoint"] for e in ordered] == [
        "/c/ep1",
        "ep1",
        "/c/ep2",
        "ep2",
        "/c/ep3",
        "ep3",
        "gone",
    ]
    values = [e["metrics/val/loss"] for e in ordered if "metrics/val/loss" in e]
    assert values[-1] == 0.7  # the newest Timestamp's value (the newest arrival is ep2's, 0.4)
    assert _best_checkpoint(history, "metrics/val/loss", "min", "/nowhere", {}) == "/c/ep2"
    assert _best_checkpoint(history, "metrics/val/loss", "max", "/nowhere", {}) == "/c/ep3"


# -- real sweeps --------------------------------------------------------------------------------
#
# ONE sweep carries both real-sweep tests (it was two, of 3 trials each: 6 Ray Train runs, now 3): a grid
# over the three algorithm sets under ASHA on global samples, in grid order:
#
# * the first set: 2 workers (its metrics must be the aggregate over both ranks), lr 0.2: it reaches
#   every rung first, so ASHA never stops it;
# * the second set: lr 0, which cannot learn, started beside the first: it trains once ASHA has the
#   first one's result at 128 samples (`WaitForTheFirstRung`), and ASHA stops it there (its first rung);
# * the third set: lr 1.0, the trial after the stopped one; it learns faster than the first, so ASHA
#   lets it finish too (the report then compares two finished trials).
#
# The first two trials' workers take 2 of the cluster's 4 CPUs (2 x 0.25 + 1.5: Ray Data has the rest),
# the third's worker 3: if the stopped trial's workers were not released it could never start.
# The sweep ranks on eval accuracy, evaluated at every report. Measured in process (three row orders;
# the sweep's own order gave the first of each): lr 0 keeps the untrained model's 0.26; the first trial
# is at 0.46-0.52 at 128 samples and 0.58-0.61 at 256; the third at 0.59-0.63 and 0.81-0.88. So the
# stop at 128 and the third's two rungs cannot miss.

LRS = (0.2, 0.0, 1.0)  # the grid's trials in SETS order: good (2 workers), bad, after


def _set_index(spec) -> int:
    return SETS.index(spec.config.algorithms)


def _two_workers_on_the_first_set(spec) -> int:
    return 2 if _set_index(spec) == 0 else 1


class WaitForTheFirstRung(Callback):
    """The trial beside the first starts training (its worker group up, its data not yet read) only once ASHA
    has the first trial's result at 128 samples (`_mark_first_rung`'s file): a trial first at a rung is never
    stopped, so the first must be first there."""

    def __init__(self, folder: str, stop: str) -> None:
        self.folder, self.stop = folder, stop

    def fit_start(self, state, logger) -> None:
        wait_until(lambda: os.path.exists(os.path.join(self.folder, "first-128")), self.stop)


def _mark_first_rung(folder: str):
    """A Tune callback (on the driver, after the scheduler's ``on_trial_result``): a file once the first trial's
    result at 128 samples or later has been scored."""
    from ray import tune

    class MarkFirstRung(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            if trial.config.get("lr") == LRS[0] and result.get("time/sample", 0) >= 128:
                open(os.path.join(folder, "first-128"), "w").close()

    return MarkFirstRung()


def _grid_callbacks(marks: str, dumps: str, rungs: str, stop: str):
    """Markers for every trial; the per-rank losses of the one 2-worker trial; the second trial's wait."""

    def callbacks(config):
        two = (config.get("trainer") or {}).get("num_workers") == 2
        wait = [WaitForTheFirstRung(rungs, stop)] if config.get("lr") == LRS[1] else []
        return marker_callbacks(marks)(config) + ([LossDump(dumps)] if two else []) + wait

    return callbacks


@pytest.fixture(scope="module")
def asha_grid(ray_cluster, tmp_path_factory):
    """The sweep, once. Yields ``args`` (to run it again), ``result``, ``out`` (what it printed), the
    ``marks``/``dumps`` folders, ``storage`` and ``released`` (placement groups still live and the free
    and total CPUs, once they were all free again or after 60 s)."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.ray.checkpointing.validation import AsyncValidation

    tmp = tmp_path_factory.mktemp("asha_grid")
    marks, dumps, rungs, stop = tmp / "marks", tmp / "dumps", tmp / "rungs", str(tmp / "stop")
    for folder in (marks, dumps, rungs):
        folder.mkdir()
    args = dict(
        trainer=_trainer(
            str(marks),
            checkpoint=CheckpointConfig(save_interval="1ep", async_save=False),
            deterministic_split=True,
            callbacks=_grid_callbacks(str(marks), str(dumps), str(rungs), stop),
            datasets=datasets_with_val,
            eval_interval="4ba",  # with every report: ASHA compares eval accuracy at its first rung
            # The second (last) checkpoint of each trial; no CPU: the trial's workers and Ray Data have the CPUs.
            validation=AsyncValidation(datasets=["val"], every=2, resources={"CPU": 0}),
        ),
        param_space={
            "algorithms": algorithm_sets_grid(SETS),
            "lr": tune.sample_from(lambda spec: LRS[_set_index(spec)]),
            # The first set's trial: 2 workers of 16 rows, the same global batch of 32 as the others.
            "trainer": {
                "num_workers": tune.sample_from(_two_workers_on_the_first_set),
                "batch_size": tune.sample_from(lambda spec: 32 // _two_workers_on_the_first_set(spec)),
                "resources_per_worker": tune.sample_from(lambda spec: {"CPU": (0.25, 1.5, 3)[_set_index(spec)]}),
            },
        },
        metric="metrics/eval/accuracy",
        mode="max",
        max_concurrent_trials=2,
        callbacks=[_mark_first_rung(str(rungs))],
        scheduler=ASHAScheduler(
            time_attr="time/sample", max_t=2 * ROWS, grace_period=128, reduction_factor=2, stop_last_trials=False
        ),
        storage_path=str(tmp / "sweeps"),
        name="grid",
        verbose=1,
    )
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            result = sweep(**args)
    finally:
        open(stop, "w").close()
    out = printed.getvalue()
    print(out)
    # Nothing stays reserved once the sweep is over.
    deadline = time.time() + 60
    while True:
        live = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
        free, total = ray.available_resources().get("CPU"), ray.cluster_resources()["CPU"]
        if (not live and free == total) or time.time() > deadline:
            break
        time.sleep(1)
    yield {
        "args": args,
        "result": result,
        "out": out,
        "marks": marks,
        "dumps": dumps,
        "storage": tmp / "sweeps",
        "released": (live, free, total),
    }


def test_grid_over_three_algorithm_sets(asha_grid):
    """A grid over three algorithm sets (the sweep report, the best checkpoint, restore-or-refuse), one
    of whose trials (the first set) runs 2 workers: its metrics are the aggregate over both ranks.
    Each finished trial's "val" set is validated asynchronously (a Ray task on its last checkpoint): its
    metrics reach Tune's results at that checkpoint's Timestamp.

    The aggregate check was a sweep of its own (``test_trial_metrics_are_the_aggregate_over_ranks``), and
    this grid another sweep than ASHA's; one Tune sweep now carries the three (see "real sweeps" above).
    """
    from raytrain_events.checkpoint.folder.store import list_checkpoints

    args, result, marks, dumps = asha_grid["args"], asha_grid["result"], asha_grid["marks"], asha_grid["dumps"]
    print(result.to_table())
    assert len(result.rows) == 3
    # The sweep's report: one figure comparing the algorithm sets, and the results table best first.
    from png_checks import check_png

    from raytrain_events.report import write_report
    from raytrain_events.report.plots import SWEEP_SIZE

    written = write_report(result.path)
    assert written["kind"] == "sweep"
    html = open(os.path.join(result.path, "report.html")).read()
    assert 'src="sweep.png"' in html and "metrics/eval/accuracy (max)" in html
    check_png(os.path.join(result.path, "sweep.png"), size=SWEEP_SIZE)
    assert sorted(row["algorithms"] for row in result.rows) == sorted(algorithm_set_label(s) for s in SETS)
    finished = [row for row in result.rows if row["status"] == "completed"]
    # The first and the third trial finish (see "real sweeps" above); the report compares the finished trials
    # (those with a trial record).
    assert sorted(row["lr"] for row in finished) == sorted([LRS[0], LRS[2]]), result.to_table()
    positions = [html.index(os.path.basename(row["path"].rstrip("/"))) for row in finished]
    assert positions == sorted(positions)  # best first, like SweepResult.rows
    for row in result.rows:
        index = [algorithm_set_label(s) for s in SETS].index(row["algorithms"])
        world = 2 if index == 0 else 1
        assert row["status"] in ("completed", "stopped"), row
        assert row["world_size"] == world and row["time/batch"] == row["time/sample"] // 32
        assert 0.0 <= row["metrics/eval/accuracy"] <= 1.0
        assert row["lr"] == LRS[index]
        assert row["run_url"].startswith(str(asha_grid["storage"] / "grid"))
    for row in finished:
        # The global Timestamp, summed over the ranks: all rows, twice, in 32-row global batches.
        assert row["time/sample"] == 2 * ROWS and row["time/epoch"] == 2
        assert row["time/batch"] == 2 * ROWS // 32
        # Each trial's Train run, with its checkpoints, has its own folder in the sweep's storage.
        assert len(list_checkpoints(row["run_url"] + "/checkpoints")) == 2
        assert row["checkpoint"].startswith(row["run_url"] + "/checkpoints/") and os.path.isdir(row["checkpoint"])
        # The async validation's metrics reached Tune, at the validated checkpoint's Timestamp.
        history = result.histories[row["trial_id"]]
        saved = [e for e in history if e.get("checkpoint_path")]
        (validated,) = [e for e in history if "validation" in e]
        assert validated["validation"] == "async" and 0.0 <= validated["metrics/val/accuracy"] <= 1.0, validated
        assert validated["validated_checkpoint"] == os.path.basename(saved[1]["checkpoint_path"].rstrip("/"))
        assert validated["time/sample"] == saved[1]["time/sample"] == 2 * ROWS
        assert not any("metrics/val/accuracy" in e for e in history if "validation" not in e)  # not in-loop
    best = result.best
    assert best["metrics/eval/accuracy"] == max(row["metrics/eval/accuracy"] for row in result.rows)
    assert result.best_config["algorithms"] == result.best_algorithms  # the best trial's config names its set
    assert result.best_algorithms in SETS
    assert result.best_label == algorithm_set_label(result.best_algorithms)
    table = result.to_table()
    for s in SETS:
        assert algorithm_set_label(s) in table
    assert table.splitlines()[2].startswith("*")  # best first
    tags = {trial_tag({"algorithms": s, "lr": lr}) for s, lr in zip(SETS, LRS)}
    assert markers(str(marks), "start") == dict.fromkeys(tags, 1)  # each trial's run started once
    ended = {trial_tag(row["config"]): 1 for row in finished}
    assert markers(str(marks), "end") == ended  # and each finished trial's ended once
    # The best checkpoint is the best trial's reported checkpoint with the best metric (ties: the newest).
    reported = [e for e in result.histories[best["trial_id"]] if e.get("checkpoint_path")]
    assert len(reported) == 2
    newest_best = max(reversed(reported), key=lambda e: e["metrics/eval/accuracy"])
    assert result.best_checkpoint == newest_best["checkpoint_path"] == best["checkpoint"]
    _check_aggregate_over_ranks(result, dumps)
    # The same storage/name again: the finished sweep is restored (nothing trains) -- or refused.
    with pytest.raises(FileExistsError, match="resume=True"):
        sweep(**args, resume=False)
    again = sweep(**{**args, "verbose": 0})
    assert [(r["trial_id"], r["metrics/eval/accuracy"]) for r in again.rows] == [
        (r["trial_id"], r["metrics/eval/accuracy"]) for r in result.rows
    ]
    assert markers(str(marks), "start") == dict.fromkeys(tags, 1)
    assert markers(str(marks), "end") == ended


def _check_aggregate_over_ranks(result, dumps) -> None:
    """The 2-worker trial's metrics are the aggregate over its ranks, not rank 0's."""
    (row,) = [r for r in result.rows if r["world_size"] == 2]
    history = [e for e in result.histories[row["trial_id"]] if "validation" not in e]  # the training reports
    assert all(entry["world_size"] == 2 for entry in history)
    assert [e["time/sample"] for e in history if "train/loss" in e] == [32 * 4 * k for k in range(1, 5)]
    # train/loss is the mean over both ranks' batches in each report window, not rank 0's mean.
    ranks = [torch.load(dumps / f"losses-rank{r}.pt", weights_only=True) for r in range(2)]
    previous, checked = 0, 0
    for entry in history:
        if "train/loss" not in entry:
            continue
        window = [loss for rank in ranks for (b, loss) in rank if previous < b <= entry["time/batch"]]
        rank0 = [loss for (b, loss) in ranks[0] if previous < b <= entry["time/batch"]]
        assert entry["train/loss"] == pytest.approx(sum(window) / len(window), rel=1e-5)
        assert entry["train/loss"] != pytest.approx(sum(rank0) / len(rank0), rel=1e-6)
        previous = entry["time/batch"]
        checked += 1
    assert checked == 4
    assert bool(history[-1]["final"]) is True


def test_asha_on_global_samples_stops_the_bad_trial(asha_grid):
    """ASHA (on ``time/sample``) stops the trial that cannot learn at its first rung; the trial after it gets
    the CPUs its workers held; the console says so, one line per event."""
    result, out, total = asha_grid["result"], asha_grid["out"], 2 * ROWS
    # One line per trial event (no Tune status tables), the stop with its reason, the final table.
    assert "Trial status" not in out and "== Status ==" not in out
    assert re.search(r"\[sweep\] \S+ \(\S+\): started with \{'lr': 0\.0[,}]", out), out
    assert re.search(r"\[sweep\] \S+ \(\S+\): reported sample 128, epoch \d+, loss", out), out
    assert re.search(
        r"stopped by ASHAScheduler at time/sample=128: metrics/eval/accuracy \S+ was not among the highest", out
    ), out
    assert re.search(rf"finished at time/sample={total}, metrics/eval/accuracy \d", out), out  # its last value
    assert out.rstrip().endswith(result.to_table().splitlines()[-1].rstrip())
    rows = {row["lr"]: row for row in result.rows}
    good, bad, after = (rows[lr] for lr in LRS)
    assert good["status"] == "completed" and good["time/sample"] == total
    assert bad["status"] == "stopped"
    assert bad["time/sample"] == 128 < total  # stopped at the first rung (128 samples), long before max_t
    assert [e["time/sample"] for e in result.histories[bad["trial_id"]] if "train/loss" in e] == [128]
    assert after["time/sample"] >= 128  # the trial after the stopped one got its workers and trained
    assert result.best["lr"] == LRS[2] and result.best["status"] == "completed"  # the best learner, let finish
    # Nothing stays reserved once the sweep is over.
    live, free, total_cpus = asha_grid["released"]
    assert not live and free == total_cpus, (live, free, total_cpus)
