"""Searching the data mixture without Ray: the simplex sampler, the trial's mixture, the RegMix-style fit and its
candidate search, the stages config round trip, PBT's explore on the simplex and the mixture lineage."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.tune.mixture_pbt import MixtureExplore, mixture_segments, perturb_weights
from raytrain_events.tune.regmix import (
    best_mixture,
    fit_mixture_regression,
    read_mixture_config,
    regmix_search,
    write_mixture_config,
)
from raytrain_events.tune.simplex import (
    Simplex,
    check_mixture_choice,
    mixture_grid,
    mixture_space,
    normalize_weights,
    trial_mixture,
)

NAMES = ("help", "noise", "small")
MIXTURE = Mixture(sources={"help": 600, "noise": 600, "small": 600}, weights={"help": 1, "noise": 1, "small": 1})
UNIFORM = {"help": 1 / 3, "noise": 1 / 3, "small": 1 / 3}


def _on_simplex(weights):
    assert sorted(weights) == sorted(NAMES)
    assert all(v >= 0 for v in weights.values())
    assert math.isclose(sum(weights.values()), 1.0, abs_tol=2e-4)


# -- the search space ---------------------------------------------------------------------------


def test_mixture_space_draws_seeded_dirichlet_mixtures_on_the_simplex():
    grid = mixture_space(MIXTURE, concentration=1.0, num_samples=6, seed=3)
    draws = grid["grid_search"]
    assert len(draws) == 6 and len({tuple(sorted(d.items())) for d in draws}) == 6
    for d in draws:
        _on_simplex(d)
    assert mixture_space(MIXTURE, num_samples=6, seed=3) == grid  # the same seed: the same trials
    assert mixture_space(MIXTURE, num_samples=6, seed=4) != grid
    # A small concentration puts most of the mass on one source, a large one near equal weights.
    peaked = mixture_space(MIXTURE, concentration=0.1, num_samples=50, seed=0)["grid_search"]
    flat = mixture_space(MIXTURE, concentration=50.0, num_samples=50, seed=0)["grid_search"]
    assert np.mean([max(d.values()) for d in peaked]) > 0.8
    assert np.mean([max(d.values()) for d in flat]) < 0.45


def test_the_domain_is_sampled_by_tunes_own_seeded_variant_generator():
    """Without num_samples the space is a Tune Domain: Tune's generator (seeded) draws one mixture per trial."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    def trial_mixtures(random_state):
        generator = BasicVariantGenerator(random_state=random_state)
        space = {"mixture": mixture_space(MIXTURE, concentration={"help": 2.0, "noise": 1.0, "small": 0.5})}
        generator.add_configurations({"x": {"run": lambda config: None, "config": space, "num_samples": 4}})
        return [generator.next_trial().config["mixture"] for _ in range(4)]

    first = trial_mixtures(7)
    assert len({tuple(sorted(m.items())) for m in first}) == 4  # one draw per trial, not the same copied draw
    for m in first:
        _on_simplex(m)
    assert trial_mixtures(7) == first


def test_bad_search_spaces_are_refused_naming_the_fix():
    with pytest.raises(MixtureError, match="concentration -1.0 .*must be a finite number > 0"):
        mixture_space(MIXTURE, concentration=-1.0)
    with pytest.raises(MixtureError, match=r"concentration names \['code'\].*not sources"):
        mixture_space(MIXTURE, concentration={"help": 1, "noise": 1, "small": 1, "code": 1})
    with pytest.raises(MixtureError, match=r"\['code'\], which are not sources of the sweep's mixture"):
        check_mixture_choice(MIXTURE, mixture_grid([{"help": 0.5, "code": 0.5}]))
    with pytest.raises(MixtureError, match="sum to 0"):
        check_mixture_choice(MIXTURE, {"help": 0, "noise": 0})
    with pytest.raises(MixtureError, match="trainer has none: pass trainer=\\{'mixture'"):
        check_mixture_choice(None, mixture_space(MIXTURE, num_samples=2))
    other = Mixture(sources={"a": 10, "b": 10}, weights={"a": 1, "b": 1})
    with pytest.raises(MixtureError, match="mixture_space is over sources"):
        check_mixture_choice(MIXTURE, mixture_space(other))
    with pytest.raises(ValueError, match="num_samples=0"):
        mixture_space(MIXTURE, num_samples=0)


def test_a_trial_trains_the_base_mixture_with_its_weights_as_the_first_stage():
    staged = Mixture(
        sources={"help": 600, "noise": 600, "small": 600},
        stages={"0dur": {"help": 1, "noise": 1, "small": 1}, "0.5dur": {"help": 1}},
    )
    mixed = trial_mixture(staged, {"help": 0.7, "small": 0.3})
    assert mixed.stages == {"0dur": {"help": 0.7, "noise": 0.0, "small": 0.3}, "0.5dur": {"help": 1}}
    assert mixed.sources == staged.sources and mixed.epoch_size == staged.epoch_size
    grid = mixture_grid({"web-heavy": MIXTURE, "custom": {"help": 2, "noise": 1, "small": 1}})
    assert grid["grid_search"] == [
        {"help": 0.3334, "noise": 0.3333, "small": 0.3333},
        {"help": 0.5, "noise": 0.25, "small": 0.25},
    ]
    absolute = Mixture(sources={"help": 600, "noise": 600}, weights={"help": {"repeat": 1.0}, "noise": {"choose": 100}})
    with pytest.raises(MixtureError, match="repeat/choose amounts"):
        trial_mixture(absolute, {"help": 0.5, "noise": 0.5})


def test_sweep_refuses_a_mixture_search_before_ray_starts(tmp_path, monkeypatch):
    import raytrain_events.ray.cluster as cluster
    from raytrain_events.tune import sweep

    def no_ray():
        raise AssertionError("Ray must not start for a bad search space")

    monkeypatch.setattr(cluster, "ensure_ray", no_ray)
    trainer = dict(model=lambda c: None, optimizers=lambda m, c: None, datasets={"train": [1]}, max_duration="1ep")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    datasets = {}
    for name in NAMES:
        pq.write_table(pa.table({"x": list(range(600)), "y": [0] * 600}), str(tmp_path / f"{name}.parquet"))
        datasets[name] = ParquetRowGroups(str(tmp_path / f"{name}.parquet"))
    with_mixture = {**trainer, "datasets": datasets, "mixture": MIXTURE}
    with pytest.raises(MixtureError, match=r"\['code'\], which are not sources of the sweep's mixture"):
        sweep(
            trainer=with_mixture,
            param_space={"mixture": mixture_grid([{"help": 1, "code": 1}])},
            metric="m",
            mode="min",
            storage_path=str(tmp_path),
        )
    with pytest.raises(MixtureError, match="concentration -2"):
        sweep(
            trainer=with_mixture,
            param_space={"mixture": mixture_space(MIXTURE, concentration=-2)},
            metric="m",
            mode="min",
            storage_path=str(tmp_path),
        )
    # A trial's spec: the base mixture with the trial's weights as its first stage (plain data, as RunSpec keeps it).
    from raytrain_events.tune.trial import base_spec, trial_spec

    spec = trial_spec(base_spec(with_mixture), {"mixture": {"help": 0.6, "noise": 0.0, "small": 0.4}})
    assert Mixture.from_dict(spec.data.mixture) == trial_mixture(MIXTURE, {"help": 0.6, "small": 0.4})
    assert spec.config["mixture"] == {"help": 0.6, "noise": 0.0, "small": 0.4}
    with pytest.raises(MixtureError, match="trainer has none"):
        sweep(
            trainer=trainer,
            param_space={"mixture": mixture_space(MIXTURE, num_samples=2)},
            metric="m",
            mode="min",
            storage_path=str(tmp_path),
        )
    # PBT over the mixture: in a sweep that does not search it (PBT would explore nothing), and over a staged base
    # mixture (a copy's switch can come before a later stage's start).
    from raytrain_events.tune import pbt_scheduler

    pbt = pbt_scheduler("128sp", mixture=mixture_space(MIXTURE), seed=0)
    with pytest.raises(MixtureError, match=r"param_space has no 'mixture'.*mixture_space\(<the trainer's mixture>"):
        sweep(trainer=with_mixture, param_space={}, scheduler=pbt, metric="m", mode="min", storage_path=str(tmp_path))
    staged = Mixture(
        sources=MIXTURE.sources, stages={"0dur": {"help": 1, "noise": 1, "small": 1}, "0.7dur": {"help": 1}}
    )
    with pytest.raises(MixtureError, match=r"one-stage base mixture.*\['0dur', '0.7dur'\].*mixture_grid"):
        sweep(
            trainer={**with_mixture, "mixture": staged},
            param_space={"mixture": mixture_space(staged, num_samples=2)},
            scheduler=pbt_scheduler("128sp", mixture=mixture_space(staged), seed=0),
            metric="m",
            mode="min",
            storage_path=str(tmp_path),
        )


# -- the RegMix-style fit -----------------------------------------------------------------------


def _true_loss(w):
    """A held-out loss shaped like the example's: the helpful source lowers it, noise raises it, and the small
    source is needed, but only a little (its benefit saturates after a few percent)."""
    return 1.0 - 0.5 * w["help"] + 0.3 * w["noise"] + 0.4 * math.exp(-w["small"] / 0.05)


def _trials(n, seed=1, noise=0.005):
    rng = np.random.default_rng(seed)
    weights = mixture_space(MIXTURE, num_samples=n, seed=seed)["grid_search"]
    return weights, [_true_loss(w) + rng.normal(0, noise) for w in weights]


@pytest.mark.parametrize("model", ["gp", "ridge"])  # (lightgbm: tests/tune/test_mixture_choice.py)
def test_the_fit_predicts_held_out_trials_and_its_choice_beats_uniform(model):
    weights, losses = _trials(20)
    fit = fit_mixture_regression(weights, losses, names=NAMES, model=model, seed=0)
    assert fit.n_points == 20 and fit.folds == 5
    assert fit.cv_rmse < fit.baseline_rmse / 3  # far below predicting the mean
    assert fit.cv_spearman > 0.9
    choice = best_mixture(fit, candidates=5000, seed=0)
    chosen, predicted = choice.weights, choice.predicted
    _on_simplex(chosen)
    # Measured here: uniform's true loss 0.934; the choice's 0.60-0.62 (gp) / 0.62 (ridge).
    assert _true_loss(chosen) < _true_loss(UNIFORM) - 0.25
    assert _true_loss(chosen) < min(_true_loss(w) for w in weights) + 0.05  # as good as the best trial, or near
    assert abs(predicted - _true_loss(chosen)) < 0.1
    assert best_mixture(fit, candidates=5000, seed=0) == choice  # seeded


def test_the_fit_refuses_too_few_or_broken_trials():
    weights, losses = _trials(3)
    with pytest.raises(ValueError, match="at least 4 trials"):
        fit_mixture_regression(weights, losses)
    weights, losses = _trials(6)
    with pytest.raises(ValueError, match="not finite"):
        fit_mixture_regression(weights, [*losses[:-1], float("nan")])
    with pytest.raises(ValueError, match="model='xgb'.*'lightgbm'"):
        fit_mixture_regression(weights, losses, model="xgb")


def test_regmix_search_over_a_sweeps_rows_writes_a_stages_config_a_run_reads_unchanged(tmp_path):
    weights, losses = _trials(12)
    rows = [
        {"trial_id": f"t{i}", "status": "completed", "config": {"mixture": w}, "eval/loss": v}
        for i, (w, v) in enumerate(zip(weights, losses))
    ]
    rows.append({"trial_id": "failed", "status": "error", "config": {"mixture": UNIFORM}, "eval/loss": 0.0})
    result = SimpleNamespace(rows=rows, metric="eval/loss", mode="min")
    found = regmix_search(result, MIXTURE, candidates=3000)
    assert len(found.trials) == 12  # the failed trial is not fitted
    assert found.mixture == trial_mixture(MIXTURE, found.weights)
    assert "held-out RMSE" in found.report() and "chosen mixture" in found.report()
    for name in ("chosen.yaml", "chosen.json"):
        url = write_mixture_config(found.mixture, str(tmp_path / "out" / name))
        assert read_mixture_config(url) == found.mixture
        assert Mixture.from_dict(found.mixture.to_dict()) == found.mixture
    memory = write_mixture_config(found.mixture, "memory://regmix-test/chosen.yaml")
    assert read_mixture_config(memory) == found.mixture
    with pytest.raises(ValueError, match="maximised"):
        regmix_search(SimpleNamespace(rows=rows, metric="eval/loss", mode="max"), MIXTURE)


# -- PBT over mixtures ----------------------------------------------------------------------------


def test_explore_perturbs_on_the_simplex_keeps_zeros_and_is_seeded():
    rng = np.random.default_rng(0)
    donor = {"help": 0.6, "noise": 0.0, "small": 0.4}
    moved = [perturb_weights(donor, rng, scale=0.3) for _ in range(20)]
    for w in moved:
        _on_simplex(w)
        assert w["noise"] == 0.0
    assert len({w["help"] for w in moved}) > 10
    assert max(abs(w["help"] - 0.6) for w in moved) < 0.35  # near the donor, not a fresh draw

    space = mixture_space(MIXTURE)
    assert isinstance(space, Simplex)
    explore = MixtureExplore(space, scale=0.3, resample_probability=0.0, seed=5)
    config = explore({"mixture": dict(donor), "lr": 0.1})
    assert config["lr"] == 0.1 and config["mixture"] != donor
    assert MixtureExplore(space, resample_probability=0.0, seed=5)({"mixture": dict(donor)}) == {
        "mixture": config["mixture"]
    }
    resampled = MixtureExplore(space, resample_probability=1.0, seed=5)({"mixture": dict(donor)})["mixture"]
    assert resampled["noise"] > 0  # a resample can bring a source back
    with pytest.raises(MixtureError, match="mixture_scale=-0.1"):
        MixtureExplore(space, scale=-0.1)


def test_pbt_scheduler_explores_the_mixture_on_the_simplex_and_checks_its_arguments():
    """``pbt_scheduler(mixture=...)`` gives Tune's PBT `MixtureExplore` (refused on main: a copy could not switch)."""
    from ray.tune.schedulers import PopulationBasedTraining

    from raytrain_events.tune import pbt_scheduler

    # (Tune calling the explore on an exploit is checked on real Ray: tests/tune/test_tune_mixture_example.py.)
    scheduler = pbt_scheduler("256sp", mixture=mixture_space(MIXTURE), seed=0, resample_probability=0.0)
    assert isinstance(scheduler, PopulationBasedTraining)
    with pytest.raises(TypeError, match="takes mixture_space"):
        pbt_scheduler("256sp", mixture={"help": 1.0})
    with pytest.raises(MixtureError, match="mixture_scale"):
        pbt_scheduler("256sp", mixture=mixture_space(MIXTURE), mixture_scale=0)
    assert pbt_scheduler("256sp", lr=[0.1, 0.2]) is not None  # PBT over the lr of a mixture search works


def test_the_lineage_says_which_mixture_trained_the_model_over_which_samples():
    lineage = [
        {
            "copied_trial": "trial_b",
            "counters": {"sample": 512},
            "from_mixture": {"help": 0.8, "noise": 0.1, "small": 0.1},
            "mixture": {"help": 0.7, "noise": 0.1, "small": 0.2},
        },
        {
            "copied_trial": "trial_c",
            "counters": {"sample": 1024},
            "from_mixture": {"help": 0.5, "noise": 0.0, "small": 0.5},
            "mixture": {"help": 0.6, "noise": 0.0, "small": 0.4},
        },
    ]
    segments = mixture_segments("trial_a", {"help": 0.1, "noise": 0.8, "small": 0.1}, lineage, end=2048)
    assert segments == [
        (0, 1024, {"help": 0.5, "noise": 0.0, "small": 0.5}, "trial_c"),
        (1024, 2048, {"help": 0.6, "noise": 0.0, "small": 0.4}, "trial_a"),
    ]
    assert mixture_segments("trial_a", UNIFORM, [], end=64) == [(0, 64, UNIFORM, "trial_a")]
    assert normalize_weights({"help": 2, "noise": 1, "small": 1}, NAMES) == {"help": 0.5, "noise": 0.25, "small": 0.25}


def test_the_results_table_shows_each_trials_weights_and_tokens_per_source(tmp_path):
    import pandas as pd

    from raytrain_events.core.time import Time
    from raytrain_events.tune.results import make_result

    def trial(name, weights, loss, tokens):
        entry = {"time/sample": 600, "time/token": sum(tokens), "eval/loss": loss, "final": True}
        entry.update({f"mixture/tokens/{n}": t for n, t in zip(NAMES, tokens)})
        entry.update({f"mixture/samples/{n}": t // 4 for n, t in zip(NAMES, tokens)})
        return SimpleNamespace(
            config={"mixture": weights},
            metrics_dataframe=pd.DataFrame([entry]),
            metrics=entry,
            path=str(tmp_path / name),
            error=None,
        )

    grid = [
        trial("trial_a", {"help": 0.5, "noise": 0.25, "small": 0.25}, 0.7, [1200, 600, 600]),
        trial("trial_b", {"help": 0.2, "noise": 0.6, "small": 0.2}, 0.9, [480, 1440, 480]),
    ]
    spec = SimpleNamespace(algorithms=[], max_duration=Time.from_timestring("600sp"))
    result = make_result(
        grid,
        metric="eval/loss",
        mode="min",
        spec=spec,
        experiment_url=str(tmp_path),
        storage_options={},
        time_attr="time/sample",
    )
    best = result.best
    assert best["mixture/help"] == 0.5 and best["mixture/tokens/help"] == 1200
    assert sum(best[f"mixture/tokens/{n}"] for n in NAMES) == best["time/token"]
    table = result.to_table()
    header = table.splitlines()[0].split()
    assert header[3:6] == ["mixture/help", "mixture/noise", "mixture/small"]
    assert header[-3:] == ["mixture/tokens/help", "mixture/tokens/noise", "mixture/tokens/small"]
    assert "1440" in table.splitlines()[3]
