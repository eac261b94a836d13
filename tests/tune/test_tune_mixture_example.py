"""``examples/tune_mixture.py``: the RegMix-style search finds a mixture that beats uniform weights on the held-out task.

The one run of the example (proxies with the local `Trainer`, then full runs of the chosen and the
uniform mixture over two seeds). The margin asserted is the measured one with room for another
machine's float order: measured 0.21 (16 trials, 3 seeds) and 0.20 (this test's 12 trials, 2 seeds).
"""

from __future__ import annotations

import importlib.util
import os

from raytrain_events.core.mixture import Mixture

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location(
        "tune_mixture_example", os.path.join(REPO, "examples", "tune_mixture.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_searched_mixture_beats_uniform_on_the_held_out_task(tmp_path, capsys):
    example = _example()
    out = str(tmp_path / "chosen.yaml")
    found = example.main(["--trials", "12", "--seeds", "2", "--out", out])
    fit = found["found"].fit
    assert fit.n_points == 12 and fit.cv_rmse < fit.baseline_rmse / 2  # the fit predicts held-out trials
    weights = found["found"].weights
    assert weights["help"] > weights["small"] > weights["noise"]  # noise is left out, small kept in a smaller share
    assert weights["noise"] < 0.1 and weights["small"] > 0.05
    assert found["margin"] > 0.1  # measured 0.20 here (chosen 0.17, uniform 0.38)
    assert all(c < u for c, u in zip(found["chosen_losses"], found["uniform_losses"]))  # on every seed
    with open(out) as f:
        assert "stages" in f.read()
    assert example.read_mixture_config(out) == Mixture.from_dict(found["found"].mixture.to_dict())
    printed = capsys.readouterr().out
    assert "held-out RMSE" in printed and "lower by" in printed
