"""The regression behind the mixture search: a fit of loss over mixture weights, with its uncertainty.

`fit_mixture_regression` fits the loss each proxy reported as a function of its weights with one
of three models, each giving a mean and an uncertainty (the standard deviation of the mean, not of
one more noisy run) at any weights:

* ``"gp"`` (default): a Gaussian process (scikit-learn; an RBF kernel with one length scale per
  source plus a noise term). The length scales are bounded to ``[0.05, 3]`` on weights in ``[0, 1]``
  (3 already reads as "nearly linear in this source"; the old ``1e3`` ceiling let the fit drop a
  source), and the noise term never goes below `NOISE_FLOOR` of the losses' variance (the old
  ``1e-8`` floor made the fit interpolate the proxies exactly).
* ``"ridge"``: Bayesian ridge regression on the weights and their logs (the penalty and the noise
  fitted by evidence; the uncertainty is the coefficients' posterior).
* ``"lightgbm"``: RegMix's model, gradient-boosted trees (LightGBM) on the weights; the
  uncertainty is the spread of a bag of `LGBM_BAG` boosted models, each fitted on a bootstrap
  resample of the proxies.

The noise (how far two proxies with the same weights land apart) comes from repeats when there
are any (proxies with the same weights, e.g. several seeds: the pooled within-group variance,
held fixed in the fit), else from ``noise=`` (a standard deviation the user measured), else the
model fits it. K-fold cross-validation measures the fit's held-out error (RMSE beside predicting
the mean, and the rank correlation: RegMix's measure).

Pure functions of their inputs and a seed: no Ray, no I/O.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raytrain_events.tune.simplex import normalize_weights

__all__ = ["MixtureFit", "fit_mixture_regression", "MODELS", "INPUTS", "weight_matrix", "NOISE_FLOOR", "LGBM_BAG"]

#: The models `fit_mixture_regression` takes.
MODELS = ("gp", "ridge", "lightgbm")
#: The least noise variance the GP may fit, as a share of the losses' variance (the losses' spread is never all signal).
NOISE_FLOOR = 1e-3
#: Boosted models in the ``"lightgbm"`` fit's bag (their spread is its uncertainty).
LGBM_BAG = 8
_MIN_POINTS = 4
#: ``inputs="log"``: the GP's and LightGBM's inputs are ``log(w + LOG_EPS)``, for a loss that moves with a source's
#: share in ratios (0.01 -> 0.02 matters as 0.3 -> 0.6 does); ``"shares"`` (default): the weights themselves.
LOG_EPS = 0.02
INPUTS = ("shares", "log")
_EPS = 1e-3  # ridge features: log(w + eps), so a weight of 0 stays finite


def _require(module: str, extra: str = "mixsearch") -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"The mixture regression needs {module.split('.')[0]}: pip install 'raytrain_events[{extra}]'."
        ) from None


def check_model(model: Any) -> str:
    """``model`` if it is one of `MODELS`, else a ValueError naming them."""
    if model not in MODELS:
        raise ValueError(
            f"model={model!r}: use 'gp' (a Gaussian process), 'ridge' (Bayesian ridge) or 'lightgbm' (RegMix's "
            "gradient-boosted trees)."
        )
    return str(model)


def weight_matrix(weights: Sequence[Any], names: Sequence[str]) -> np.ndarray:
    """One row per weight dict (or weight row), over ``names``, summing to 1."""
    rows = []
    for w in weights:
        if isinstance(w, dict):
            normalized = normalize_weights(w, names)
            rows.append([normalized[n] for n in names])
        else:
            rows.append(list(w))
    x = np.asarray(rows, dtype=float).reshape(-1, len(names))
    return x / x.sum(axis=1, keepdims=True)


def _repeat_noise(x: np.ndarray, y: np.ndarray) -> Tuple[Optional[float], int]:
    """(pooled within-group standard deviation, degrees of freedom) over proxies with the same weights."""
    groups: Dict[Tuple[float, ...], List[float]] = {}
    for row, value in zip(np.round(x, 4), y):
        groups.setdefault(tuple(row), []).append(float(value))
    dof = sum(len(g) - 1 for g in groups.values())
    if dof == 0:
        return None, 0
    ss = sum(float(np.sum((np.asarray(g) - np.mean(g)) ** 2)) for g in groups.values())
    return math.sqrt(ss / dof), dof


class _Bag:
    """LightGBM models on bootstrap resamples: mean and spread of their predictions."""

    def __init__(self, seed: int, size: int = LGBM_BAG) -> None:
        self.seed, self.size = seed, size
        self.models: List[Any] = []

    def fit(self, x: np.ndarray, y: np.ndarray) -> _Bag:
        lgb = _require("lightgbm")
        rng = np.random.default_rng(self.seed)
        self.models = []
        for i in range(self.size):
            rows = rng.integers(0, len(y), size=len(y)) if self.size > 1 else np.arange(len(y))
            model = lgb.LGBMRegressor(
                n_estimators=100,
                learning_rate=0.1,
                n_jobs=1,
                num_leaves=8,
                min_child_samples=2,
                min_data_in_bin=1,
                linear_tree=False,
                random_state=self.seed + i,
                verbose=-1,
            )
            self.models.append(model.fit(x[rows], y[rows]))
        return self

    def predict(self, x: np.ndarray, return_std: bool = False) -> Any:
        each = np.stack([m.predict(x) for m in self.models])
        return (each.mean(axis=0), each.std(axis=0)) if return_std else each.mean(axis=0)


def _features(x: np.ndarray, kind: str, inputs: str = "shares") -> np.ndarray:
    if kind == "ridge":  # a linear model on both: the shares and their logs
        return np.hstack([x, np.log(x + _EPS)])
    return np.log(x + LOG_EPS) if inputs == "log" else x


def _make_model(kind: str, n_sources: int, seed: int, noise_var: Optional[float], y_var: float, inputs: str) -> Any:
    if kind == "gp":
        _require("sklearn")
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

        if noise_var is not None:  # normalize_y: the kernel sees the losses over their std
            white = WhiteKernel(max(noise_var / y_var, 1e-6), "fixed")
        else:
            white = WhiteKernel(0.05, (NOISE_FLOOR, 1.0))
        scale, bounds = (1.0, (0.1, 30.0)) if inputs == "log" else (0.3, (0.05, 3.0))  # log(0.02)..0: 4x wider
        kernel = ConstantKernel(1.0, (1e-2, 1e2)) * RBF([scale] * n_sources, bounds) + white
        return GaussianProcessRegressor(kernel=kernel, normalize_y=True, n_restarts_optimizer=2, random_state=seed)
    if kind == "ridge":
        _require("sklearn")
        from sklearn.linear_model import BayesianRidge

        if noise_var is not None:  # the noise precision held at the repeats' (a tight Gamma prior on it)
            return BayesianRidge(alpha_init=1.0 / noise_var, alpha_1=1e6, alpha_2=1e6 * noise_var)
        return BayesianRidge()
    return _Bag(seed)


@dataclass
class MixtureFit:
    """A fitted regression from mixture weights (over ``names``) to the target loss, with its uncertainty."""

    names: Tuple[str, ...]
    model: Any  # the fitted estimator (scikit-learn's, or a bag of LightGBM models)
    kind: str
    n_points: int
    cv_rmse: float  # held-out RMSE of the K-fold predictions
    cv_spearman: float  # rank correlation of the held-out predictions with the losses
    baseline_rmse: float  # held-out RMSE of predicting the training folds' mean loss
    folds: int
    points: np.ndarray  # the proxies' weights (one row each, over names)
    losses: np.ndarray  # their losses
    noise_std: float  # one proxy's noise (standard deviation)
    noise_from: str  # "repeats", "given" or "fit"
    inputs: str = "shares"  # "shares" or "log" (`INPUTS`)

    def predict_rows(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(mean, std) of the loss at each row of weights; std is the mean's uncertainty (one run's noise removed)."""
        feats = _features(np.asarray(x, dtype=float), self.kind, self.inputs)
        mean, std = self.model.predict(feats, return_std=True)
        var = np.asarray(std, dtype=float) ** 2
        if self.kind != "lightgbm":  # the GP's and ridge's std include one run's noise: the mean's excludes it
            var = var - self.noise_std**2
        return np.asarray(mean, dtype=float), np.sqrt(np.clip(var, 0.0, None))

    def predict(self, weights: Sequence[Any]) -> List[float]:
        """The predicted loss of each weight dict."""
        return [float(v) for v in self.predict_rows(weight_matrix(weights, self.names))[0]]

    def predict_std(self, weights: Sequence[Any]) -> List[Tuple[float, float]]:
        """(predicted loss, its uncertainty) of each weight dict."""
        mean, std = self.predict_rows(weight_matrix(weights, self.names))
        return [(float(m), float(s)) for m, s in zip(mean, std)]

    def describe(self) -> str:
        return (
            f"{self.kind} fit on {self.n_points} trials, {self.folds}-fold held-out RMSE {self.cv_rmse:.4g} "
            f"(predicting the mean: {self.baseline_rmse:.4g}), rank correlation {self.cv_spearman:.3f}, "
            f"noise {self.noise_std:.3g} ({self.noise_from})"
        )


def _fitted_noise(kind: str, model: Any, y_var: float) -> float:
    if kind == "gp":
        return math.sqrt(float(model.kernel_.k2.noise_level) * y_var)
    if kind == "ridge":
        return math.sqrt(1.0 / float(model.alpha_))
    return 0.0


def _check_fit_args(
    weights: Sequence[Any], losses: Sequence[float], model: str, inputs: str, noise: Any, folds: Any
) -> None:
    """Refuse what `fit_mixture_regression` cannot fit, naming the fix."""
    check_model(model)
    if inputs not in INPUTS:
        raise ValueError(f"inputs={inputs!r}: use 'shares' (the weights) or 'log' (log(w + {LOG_EPS}): ratios).")
    if len(weights) != len(losses):
        raise ValueError(f"{len(weights)} weight dicts but {len(losses)} losses: give one loss per trial.")
    if len(weights) < _MIN_POINTS:
        raise ValueError(
            f"The mixture regression needs at least {_MIN_POINTS} trials with the metric, got {len(weights)}: "
            "run more trials (RegMix fits a few dozen)."
        )
    bad = [v for v in losses if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        raise ValueError(f"Losses {bad} are not finite numbers: drop the trials that diverged or failed first.")
    if noise is not None and not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise > 0):
        raise ValueError(f"noise={noise!r} must be a standard deviation > 0 (or None: from repeats, else fitted).")
    if not isinstance(folds, int) or isinstance(folds, bool) or folds < 0 or folds == 1:
        raise ValueError(f"folds={folds!r} must be an int >= 2 (K-fold cross-validation) or 0 (no cross-validation).")


def _fit_and_cross_validate(
    feats: np.ndarray, y: np.ndarray, folds: int, seed: int, make: Any
) -> Tuple[Any, np.ndarray, np.ndarray, int]:
    """(the model fitted on every point, K-fold held-out predictions, the training folds' means, K); K = 0: none."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import KFold

    k = min(folds, len(y))
    splitter = KFold(n_splits=max(k, 2), shuffle=True, random_state=seed)
    held_out, mean_only = np.full_like(y, np.nan), np.full_like(y, np.nan)
    with warnings.catch_warnings():  # a bound reached is reported by the fit's describe(), not a warning
        warnings.simplefilter("ignore", ConvergenceWarning)
        for train, test in splitter.split(feats) if k else ():
            held_out[test] = make().fit(feats[train], y[train]).predict(feats[test])
            mean_only[test] = y[train].mean()
        return make().fit(feats, y), held_out, mean_only, k


def fit_mixture_regression(
    weights: Sequence[Any],
    losses: Sequence[float],
    *,
    names: Optional[Sequence[str]] = None,
    model: str = "gp",
    folds: int = 5,
    noise: Optional[float] = None,
    inputs: str = "shares",
    seed: int = 0,
) -> MixtureFit:
    """Fit ``losses`` as a function of ``weights`` (one weight dict per trial) and cross-validate it.

    ``noise``: one proxy's noise (standard deviation), if measured; without it, repeats (trials with
    the same weights) give it, else the model fits it. ``inputs``: `INPUTS` (the GP's and LightGBM's).
    """
    from scipy.stats import spearmanr

    _check_fit_args(weights, losses, model, inputs, noise, folds)
    names = tuple(names or sorted({n for w in weights for n in w}))
    x = weight_matrix(weights, names)
    y = np.asarray(losses, dtype=float)
    y_var = float(np.var(y)) or 1.0
    repeat_std, _ = _repeat_noise(x, y)
    noise_std = float(noise) if noise is not None else repeat_std
    noise_from = "given" if noise is not None else "repeats" if repeat_std is not None else "fit"
    noise_var = None if noise_std is None else max(noise_std, 1e-12) ** 2
    _require("sklearn")
    fitted, held_out, mean_only, k = _fit_and_cross_validate(
        _features(x, model, inputs),
        y,
        folds,
        seed,
        lambda: _make_model(model, len(names), seed, noise_var, y_var, inputs),
    )
    rho = spearmanr(held_out, y).statistic if k and np.ptp(held_out) > 0 and np.ptp(y) > 0 else float("nan")
    if noise_std is None:
        noise_std = _fitted_noise(model, fitted, y_var)
    return MixtureFit(
        names=names,
        model=fitted,
        kind=model,
        n_points=len(y),
        cv_rmse=float(np.sqrt(np.mean((held_out - y) ** 2))),
        cv_spearman=float(rho),
        baseline_rmse=float(np.sqrt(np.mean((mean_only - y) ** 2))),
        folds=k,
        points=x,
        losses=y,
        noise_std=float(noise_std),
        noise_from=noise_from,
        inputs=inputs,
    )
