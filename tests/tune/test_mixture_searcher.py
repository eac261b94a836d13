"""The sequential mixture search (`MixtureSearcher`, Tune's Searcher interface) without Ray, and once through Tune
(a sweep interrupted mid-round and restored with `Tuner.restore`).

Driven as Tune drives it (``suggest`` per trial, ``on_trial_complete`` with the trial's last result):
seeded draws first, a round waits until its trials ended, the next batch lands where the fit's
expected improvement is (closer to the known best than the draws were), and a searcher saved
mid-round and restored (Tune's save/restore of an experiment) places the same next trials.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from raytrain_events.core.mixture import Mixture
from raytrain_events.tune.acquisition import auto_radius, tv_distance
from raytrain_events.tune.mixture_fit import weight_matrix
from raytrain_events.tune.mixture_searcher import MixtureSearcher, first_design

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from mixture_tasks import SyntheticTask  # noqa: E402

TASK = SyntheticTask(noise=0.005)
BASE = Mixture(sources={n: 100 for n in TASK.names}, weights={n: 1 for n in TASK.names})


def _searcher(**kw):
    return MixtureSearcher(
        BASE, **{"initial": 8, "batch": 3, "max_trials": 14, "metric": "loss", "seed": 1, "candidates": 1000, **kw}
    )


def _drive(searcher, start, stop, pending=()):
    """Suggest trials t<start>..t<stop-1>, completing each at once, except those in ``pending`` (left running)."""
    out = []
    for i in range(start, stop):
        suggestion = searcher.suggest(f"t{i}")
        out.append(suggestion)
        if isinstance(suggestion, dict) and f"t{i}" not in pending:
            searcher.on_trial_complete(f"t{i}", {"loss": TASK(suggestion["mixture"], 0)})
    return out


def test_rounds_wait_for_their_trials_then_place_the_next_batch_where_the_fit_points(tmp_path):
    searcher = _searcher()
    first = _drive(searcher, 0, 8, pending={"t7"})
    assert all(isinstance(s, dict) for s in first) and len({tuple(s["mixture"].values()) for s in first}) == 8
    assert searcher.suggest("t8") is None  # t7 still runs: the round is not over, Tune is asked to wait
    searcher.on_trial_complete("t7", {"loss": TASK(first[7]["mixture"], 0)})
    second = _drive(searcher, 8, 11)
    assert searcher.rounds == 1 and all(isinstance(s, dict) for s in second)
    best = np.asarray([[TASK.best[n] for n in TASK.names]])
    drawn = weight_matrix([s["mixture"] for s in first], TASK.names)
    placed = weight_matrix([s["mixture"] for s in second], TASK.names)
    assert tv_distance(placed, best).mean() < tv_distance(drawn, best).mean()  # toward the best, not uniform draws
    assert tv_distance(placed, placed)[np.triu_indices(3, 1)].min() > 0  # a batch spreads out
    rest = _drive(searcher, 11, 17)
    assert rest[-3:] == [MixtureSearcher.FINISHED] * 3 and len(searcher.observed()) == 14
    # A failed trial ends its round but is not fitted.
    failing = _searcher(max_trials=12)
    _drive(failing, 0, 7)
    assert failing.suggest("t7") is not None
    failing.on_trial_complete("t7", error=True)
    assert isinstance(failing.suggest("t8"), dict) and len(failing.observed()) == 7


@pytest.mark.parametrize("design", ["space-filling", "mixed"])
def test_a_searcher_stopped_mid_round_and_restored_places_the_same_next_trials(tmp_path, design):
    uninterrupted = _searcher(design=design)
    expected = _drive(uninterrupted, 0, 17)
    searcher = _searcher(design=design)
    before = _drive(searcher, 0, 11, pending={"t8", "t9"})  # round 1 placed (t8-t10); two of its trials still run
    path = str(tmp_path / "searcher.pkl")
    searcher.save(path)
    restored = MixtureSearcher(BASE, metric="loss", seed=99)  # Tune builds it anew (default design) ...
    restored.restore(path)  # ... and restores the saved state
    assert restored.suggest("t11") is None  # still waiting on t8 and t9
    for t in ("t8", "t9"):  # Tune re-runs the unfinished trials; they report
        restored.on_trial_complete(t, {"loss": TASK(before[int(t[1:])]["mixture"], 0)})
    after = _drive(restored, 11, 17)
    assert before + after == expected


def test_bad_searcher_arguments_are_refused():
    with pytest.raises(ValueError, match="initial=2.*>= 4"):
        MixtureSearcher(BASE, initial=2)
    with pytest.raises(ValueError, match="max_trials=4.*>= 8"):
        MixtureSearcher(BASE, max_trials=4)
    with pytest.raises(ValueError, match="criterion='best'"):
        MixtureSearcher(BASE, criterion="best")
    with pytest.raises(ValueError, match="model='xgb'"):
        MixtureSearcher(BASE, model="xgb")
    with pytest.raises(ValueError, match="trust_region=0 "):
        MixtureSearcher(BASE, trust_region=0)
    with pytest.raises(ValueError, match="mode='max'.*minimises"):
        MixtureSearcher(BASE, mode="max")
    with pytest.raises(ValueError, match="incumbents=0.*>= 1"):
        MixtureSearcher(BASE, incumbents=0)
    with pytest.raises(ValueError, match="explore=-1.*>= 0"):
        MixtureSearcher(BASE, explore=-1)
    with pytest.raises(ValueError, match="design='lhs'.*'space-filling'.*'mixed'"):
        MixtureSearcher(BASE, design="lhs")
    with pytest.raises(ValueError, match="trust_region='wide'"):
        MixtureSearcher(BASE, trust_region="wide")


def test_the_first_batch_fills_the_simplex_from_uniform_weights():
    """The first batch starts at uniform weights (what the search replaces) and spreads the rest evenly: its
    closest pair is farther apart than seeded Dirichlet draws' for every seed tried (the old first batch)."""
    for seed in range(4):
        filled = weight_matrix(_searcher(seed=seed, design="space-filling").placed, TASK.names)
        drawn = weight_matrix(_searcher(seed=seed, design="dirichlet").placed, TASK.names)
        assert filled[0] == pytest.approx(np.full(5, 0.2)) and len(np.unique(filled.round(4), axis=0)) == 8
        gaps = [tv_distance(x, x)[np.triu_indices(8, 1)].min() for x in (filled, drawn)]
        assert gaps[0] > gaps[1]
    assert MixtureSearcher(BASE).design == "space-filling"  # the default


def test_the_mixed_first_batch_leans_every_other_point_to_the_corners():
    """``design="mixed"``: the space-filling design's rows at uniform weights and every other Halton point, and in
    between the same Halton uniforms through a Dirichlet of half the concentration: rows with a source near 0
    (where the example's best mixture lies: no ``noise``), still apart from each other."""
    for seed in range(4):
        filled = first_design("space-filling", [1.0] * 5, 9, seed)
        mixed = first_design("mixed", [1.0] * 5, 9, seed)
        assert mixed[[0, 1, 3, 5, 7]] == pytest.approx(filled[[0, 1, 3, 5, 7]])  # the space-filling rows kept
        corner, plain = mixed[[2, 4, 6, 8]], filled[[2, 4, 6, 8]]
        assert (corner.min(axis=1) < plain.min(axis=1)).all()  # each leans further towards a face
        assert corner.max(axis=1).mean() > plain.max(axis=1).mean()
        assert tv_distance(mixed, mixed)[np.triu_indices(9, 1)].min() > 0.05
    searcher = _searcher(design="mixed", seed=2)
    assert weight_matrix(searcher.placed, TASK.names) == pytest.approx(first_design("mixed", [1.0] * 5, 8, 2), abs=2e-4)


def test_a_round_keeps_an_exploring_slot_outside_the_trust_region():
    """``explore=1``: of each round's batch, one trial lands where the criterion is best over the whole simplex
    (here well outside the small region around the incumbents), the others inside that region."""
    searcher = _searcher(
        inputs="log", incumbents=2, initial=6, batch=3, max_trials=9, candidates=400, explore=1, trust_region=0.05
    )
    _drive(searcher, 0, 6)
    placed = weight_matrix([s["mixture"] for s in _drive(searcher, 6, 9)], TASK.names)
    fit = searcher.fit
    best = fit.points[np.argsort(fit.predict_rows(fit.points)[0], kind="stable")[:2]]
    distance = tv_distance(placed, best).min(axis=1)
    assert distance[0] <= 0.051 and distance[1] <= 0.051 and distance[2] > 0.1


def test_the_adaptive_region_follows_turbos_rule_over_the_rounds():
    """``trust_region="adaptive"``: two rounds in a row that beat the best double the radius, two that do not
    halve it; the radius is a pure function of the losses reported (a restored searcher computes the same)."""
    searcher = _searcher(trust_region="adaptive", initial=6, batch=2, max_trials=40)
    _drive(searcher, 0, 6)
    start = auto_radius(weight_matrix(searcher.placed[:6], TASK.names))
    searcher.fit = object()  # _radius reads only the losses and the rounds' ends; the fit must merely exist
    best = min(searcher.losses.values())
    r2 = min(2 * start, 1.0)
    expected = [start, r2, r2, min(2 * r2, 1.0), min(2 * r2, 1.0), min(2 * r2, 1.0) / 2, min(2 * r2, 1.0) / 2]
    expected.append(expected[-1] / 2)  # win win (double) win win (double) fail fail (halve) fail fail (halve)
    for k, loss in enumerate([best - 0.1, best - 0.2, best - 0.3, best - 0.4, 9, 9, 9, 9]):
        searcher.placed += [searcher.placed[0]] * 2
        searcher.losses.update({len(searcher.placed) - 2: loss, len(searcher.placed) - 1: 9.0})
        searcher.ends.append(len(searcher.placed))
        assert searcher._radius() == pytest.approx(expected[k]), k


def test_a_round_fits_on_the_searchers_inputs_and_stays_near_the_incumbents():
    """The round's fit reads the searcher's ``inputs`` (it once fitted the shares whatever was asked), and the
    batch lands inside the trust region around the 2 proxies the fit ranks best, not in the simplex's corners."""
    searcher = _searcher(inputs="log", incumbents=2, initial=6, batch=2, max_trials=8, candidates=200, explore=0)
    _drive(searcher, 0, 6)
    second = _drive(searcher, 6, 8)
    fit = searcher.fit
    assert fit is not None and fit.inputs == "log" and fit.n_points == 6
    best = fit.points[np.argsort(fit.predict_rows(fit.points)[0])[:2]]
    placed = weight_matrix([s["mixture"] for s in second], TASK.names)
    assert tv_distance(placed, best).min(axis=1).max() <= auto_radius(fit.points) + 1e-3


def test_sweep_refuses_a_searcher_the_base_run_cannot_train_before_ray_starts(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import raytrain_events.ray.cluster as cluster
    from raytrain_events.core.mixture import MixtureError
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from raytrain_events.tune import mixture_space, sweep

    def no_ray():
        raise AssertionError("Ray must not start for a bad search")

    monkeypatch.setattr(cluster, "ensure_ray", no_ray)
    datasets = {}
    for name in ("a", "b", "c"):
        pq.write_table(pa.table({"x": list(range(60)), "y": [0] * 60}), str(tmp_path / f"{name}.parquet"))
        datasets[name] = ParquetRowGroups(str(tmp_path / f"{name}.parquet"))
    mixture = Mixture(sources={"a": 60, "b": 60, "c": 60}, weights={"a": 1, "b": 1, "c": 1})
    trainer = dict(
        model=lambda c: None, optimizers=lambda m, c: None, datasets=datasets, mixture=mixture, max_duration="1ep"
    )

    def run(searcher, **kw):
        args = dict(trainer=trainer, metric="m", mode="min", storage_path=str(tmp_path), search_alg=searcher)
        return sweep(**{**args, **kw})

    with pytest.raises(MixtureError, match=r"\['d'\], which are not sources of the sweep's mixture"):
        run(MixtureSearcher(["a", "b", "d"]))
    with pytest.raises(ValueError, match=r"over sources \['a', 'b'\].*has \['a', 'b', 'c'\]"):
        run(MixtureSearcher(["a", "b"]))
    with pytest.raises(ValueError, match="param_space has a 'mixture' too"):
        run(MixtureSearcher(mixture), param_space={"mixture": mixture_space(mixture, num_samples=2)})
    with pytest.raises(ValueError, match="mode is 'max'"):
        run(MixtureSearcher(mixture), mode="max")
    from ray.tune.search import ConcurrencyLimiter

    with pytest.raises(MixtureError, match="trainer has none"):
        sweep(
            trainer={**trainer, "mixture": None, "datasets": {"train": datasets["a"]}},
            metric="m",
            mode="min",
            storage_path=str(tmp_path),
            search_alg=ConcurrencyLimiter(MixtureSearcher(mixture), 2),
        )


def _synthetic_trial(config):
    from ray import tune

    tune.report({"loss": TASK(config["mixture"], 0)})


class _InterruptOnce:
    """A Tune callback that interrupts the sweep (as Ctrl-C does) once ``after`` trials ended; a flag file
    keeps the restored sweep (which unpickles this callback with the experiment) from interrupting again."""

    def __new__(cls, flag, after):
        from ray import tune

        class Interrupt(tune.Callback):
            def on_trial_complete(self, iteration, trials, trial, **info):
                if sum(t.status == "TERMINATED" for t in trials) >= after and not os.path.exists(flag):
                    open(flag, "w").close()
                    raise KeyboardInterrupt

        return Interrupt()


@pytest.mark.ray
def test_tune_runs_the_rounds_the_searcher_places(ray_cluster, tmp_path, monkeypatch):
    """Through Tune itself (a `Tuner` on the session's Ray, function trials of the synthetic loss), interrupted
    mid-round and restored (`Tuner.restore`, Tune's own resume): Tune waits on a round (``suggest`` None), saved
    the searcher's state with the experiment, re-runs the round's unfinished trials, and the trials' configs are
    the placement the searcher makes uninterrupted, driven in process."""
    import gc
    import pickle
    import time

    import mixture_tasks
    from ray import cloudpickle as ray_cloudpickle
    from ray import tune

    for module in (sys.modules[__name__], mixture_tasks):  # the trials get these by value (not on the workers' path)
        ray_cloudpickle.register_pickle_by_value(module)
    # Tune saves the experiment (the searcher's state with it) at every step of its loop, not on its adaptive
    # period: on a quick machine the period's last save came before round 1 began (seen in a quiet full run).
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "0")
    flag = str(tmp_path / "interrupted")
    free = ray_cluster.available_resources().get("CPU", 0)
    tuner = tune.Tuner(
        _synthetic_trial,
        tune_config=tune.TuneConfig(
            search_alg=_searcher(max_trials=11), num_samples=11, metric="loss", mode="min", max_concurrent_trials=2
        ),
        # Interrupted once 9 trials ended: round 1 (trials 9-11, placed after the 8 draws) has begun, not ended.
        run_config=tune.RunConfig(
            storage_path=str(tmp_path), name="rounds", verbose=0, callbacks=[_InterruptOnce(flag, 9)]
        ),
    )
    with pytest.raises(KeyboardInterrupt):
        tuner.fit()
    del tuner  # the interrupted controller's trial actors go with the last handles to them: the session's CPUs
    gc.collect()  # come back (else they stay held for every later test on the shared Ray)
    deadline = time.monotonic() + 60
    while ray_cluster.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) >= free
    saved = sorted(f for f in os.listdir(tmp_path / "rounds") if f.startswith("searcher-state"))
    assert saved and os.path.exists(flag)  # Tune's save of the searcher (what the restore reads)
    with open(tmp_path / "rounds" / saved[-1], "rb") as fh:
        state = pickle.load(fh)
    assert len(state["losses"]) < 11 and len(state["placed"]) == 11  # stopped mid-round: not every loss is in
    results = tune.Tuner.restore(str(tmp_path / "rounds"), trainable=_synthetic_trial, resume_unfinished=True).fit()
    assert results.num_errors == 0 and len(results) == 11
    ran = sorted((r.metrics["loss"], tuple(r.config["mixture"].items())) for r in results)
    reference = [s for s in _drive(_searcher(max_trials=11), 0, 11)]
    placed = sorted((TASK(s["mixture"], 0), tuple(s["mixture"].items())) for s in reference)
    assert ran == placed  # the same 8 draws and the same 3 placed after them, across the interruption


def test_round_sizes_follow_the_batch_schedule_and_the_last_size_repeats():
    """``batch=(3, 1)``: 3 trials in the first placed round, then one at a time; the schedule survives save/restore."""
    searcher = _searcher(initial=4, batch=(3, 1), max_trials=10)
    _drive(searcher, 0, 8)
    assert searcher.ends == [4, 7, 8] and searcher.rounds == 2
    state = searcher.get_state()
    again = _searcher(initial=4, batch=4, max_trials=10)
    again.set_state(state)
    _drive(searcher, 8, 11)
    _drive(again, 8, 11)
    assert searcher.ends == again.ends == [4, 7, 8, 9, 10] and searcher.placed == again.placed
    with pytest.raises(ValueError, match=r"batch=\(\)\) names no round"):
        MixtureSearcher(BASE, batch=())
    with pytest.raises(ValueError, match=r"batch\[1\]=0.*>= 1"):
        MixtureSearcher(BASE, batch=(2, 0))
