"""RegMix-style proxy search: fit eval loss as a function of the mixture weights, pick the predicted best.

After a sweep of short trials with sampled mixtures (`mixture_space`), `fit_mixture_regression`
fits a regression from each trial's weights to its target loss with scikit-learn (a Gaussian
process by default: a few dozen points, a smooth response, no compiled dependency beyond
numpy/scipy; ``model="ridge"`` is a linear model on the weights and their logs), and measures its
held-out error by K-fold cross-validation (RMSE, beside the RMSE of always predicting the mean,
and the rank correlation of the held-out predictions: RegMix's measure, since only the order of
mixtures matters). `best_mixture` scores many Dirichlet candidates through the fit and averages
the top ones (RegMix's rule: one argmin of a fit over a few points is noisy).
`regmix_search` runs both on a `SweepResult` and returns the chosen `Mixture`;
`write_mixture_config` writes it as a stages config (``Mixture.to_dict()``, YAML or JSON) that a
full run reads unchanged with `read_mixture_config` / ``Mixture.from_dict``.

The fit and the search are pure functions of their inputs (and a seed): no Ray, no I/O.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.tune.simplex import normalize_weights, trial_mixture

__all__ = [
    "MixtureFit",
    "RegMixResult",
    "fit_mixture_regression",
    "best_mixture",
    "regmix_search",
    "trial_points",
    "write_mixture_config",
    "read_mixture_config",
]

_MIN_POINTS = 4
_EPS = 1e-3  # ridge features: log(w + eps), so a weight of 0 stays finite


def _sklearn() -> Any:
    try:
        import sklearn
    except ImportError:
        raise ImportError(
            "The mixture regression needs scikit-learn: pip install 'raytrain_events[mixsearch]'."
        ) from None
    return sklearn


@dataclass
class MixtureFit:
    """A fitted regression from mixture weights (over ``names``) to the target loss."""

    names: Tuple[str, ...]
    model: Any  # the fitted scikit-learn estimator
    kind: str
    n_points: int
    cv_rmse: float  # held-out RMSE of the K-fold predictions
    cv_spearman: float  # rank correlation of the held-out predictions with the losses
    baseline_rmse: float  # held-out RMSE of predicting the training folds' mean loss
    folds: int

    def predict(self, weights: Sequence[Mapping[str, float]]) -> List[float]:
        """The predicted loss of each weight dict."""
        return [float(v) for v in self.model.predict(_features([_vector(w, self.names) for w in weights], self.kind))]

    def describe(self) -> str:
        return (
            f"{self.kind} fit on {self.n_points} trials, {self.folds}-fold held-out RMSE {self.cv_rmse:.4g} "
            f"(predicting the mean: {self.baseline_rmse:.4g}), rank correlation {self.cv_spearman:.3f}"
        )


def _vector(weights: Mapping[str, float], names: Sequence[str]) -> List[float]:
    normalized = normalize_weights(weights, names)
    total = sum(normalized.values())
    return [normalized[n] / total for n in names]


def _features(rows: Sequence[Sequence[float]], kind: str) -> Any:
    import numpy as np

    x = np.asarray(rows, dtype=float)
    return np.hstack([x, np.log(x + _EPS)]) if kind == "ridge" else x


def _make_model(kind: str, n_sources: int, seed: int) -> Any:
    _sklearn()
    if kind == "gp":
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

        kernel = ConstantKernel(1.0, (1e-3, 1e3)) * RBF([0.3] * n_sources, (1e-2, 1e3)) + WhiteKernel(1e-2, (1e-8, 1.0))
        return GaussianProcessRegressor(kernel=kernel, normalize_y=True, n_restarts_optimizer=1, random_state=seed)
    if kind == "ridge":
        from sklearn.linear_model import RidgeCV

        return RidgeCV(alphas=[1e-3, 1e-2, 1e-1, 1.0, 10.0])
    raise ValueError(f"model={kind!r}: use 'gp' (a Gaussian process) or 'ridge'.")


def fit_mixture_regression(
    weights: Sequence[Mapping[str, float]],
    losses: Sequence[float],
    *,
    names: Optional[Sequence[str]] = None,
    model: str = "gp",
    folds: int = 5,
    seed: int = 0,
) -> MixtureFit:
    """Fit ``losses`` as a function of ``weights`` (one weight dict per trial) and cross-validate it."""
    import numpy as np
    from scipy.stats import spearmanr

    if len(weights) != len(losses):
        raise ValueError(f"{len(weights)} weight dicts but {len(losses)} losses: give one loss per trial.")
    if len(weights) < _MIN_POINTS:
        raise ValueError(
            f"The mixture regression needs at least {_MIN_POINTS} trials with the metric, got {len(weights)}: "
            "run more trials (RegMix fits a few dozen)."
        )
    bad = [v for v in losses if not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        raise ValueError(f"Losses {bad} are not finite numbers: drop the trials that diverged or failed first.")
    names = tuple(names or sorted({n for w in weights for n in w}))
    x = _features([_vector(w, names) for w in weights], model)
    y = np.asarray(losses, dtype=float)
    _make_model(model, len(names), seed)  # a bad model name fails before the folds
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import KFold, cross_val_predict

    k = min(folds, len(y))
    splitter = KFold(n_splits=k, shuffle=True, random_state=seed)
    with warnings.catch_warnings():  # a source that does not move the loss pins its length scale at the bound
        warnings.simplefilter("ignore", ConvergenceWarning)
        held_out = cross_val_predict(_make_model(model, len(names), seed), x, y, cv=splitter)
        fitted = _make_model(model, len(names), seed).fit(x, y)
    mean_only = np.empty_like(y)
    for train, test in splitter.split(x):
        mean_only[test] = y[train].mean()
    rho = spearmanr(held_out, y).statistic if np.ptp(held_out) > 0 and np.ptp(y) > 0 else float("nan")
    return MixtureFit(
        names=names,
        model=fitted,
        kind=model,
        n_points=len(y),
        cv_rmse=float(np.sqrt(np.mean((held_out - y) ** 2))),
        cv_spearman=float(rho),
        baseline_rmse=float(np.sqrt(np.mean((mean_only - y) ** 2))),
        folds=k,
    )


def best_mixture(
    fit: MixtureFit,
    *,
    candidates: int = 20_000,
    concentration: float = 1.0,
    top: int = 100,
    seed: int = 0,
) -> Tuple[Dict[str, float], float]:
    """(weights, predicted loss): the mean of the ``top`` best of ``candidates`` Dirichlet draws through the fit."""
    import numpy as np

    if candidates < 1 or top < 1:
        raise ValueError(f"candidates={candidates} and top={top} must be >= 1.")
    if not (isinstance(concentration, (int, float)) and concentration > 0):
        raise MixtureError(f"concentration {concentration!r} must be > 0 (1.0 samples the simplex uniformly).")
    rng = np.random.default_rng(seed)
    pool = rng.dirichlet([float(concentration)] * len(fit.names), size=candidates)
    predicted = np.asarray(fit.model.predict(_features(pool, fit.kind)))
    order = np.argsort(predicted)[: min(top, candidates)]
    chosen = dict(zip(fit.names, pool[order].mean(axis=0)))
    weights = normalize_weights({n: float(v) for n, v in chosen.items()}, fit.names)
    return weights, fit.predict([weights])[0]


def trial_points(result: Any, metric: str) -> Tuple[List[Dict[str, float]], List[float], List[str]]:
    """(weights, losses, trial ids) of a `SweepResult`'s trials that did not fail and reported ``metric``."""
    weights, losses, trials = [], [], []
    for row in result.rows:
        mixture = (row.get("config") or {}).get("mixture")
        value = row.get(metric)
        if row.get("status") == "error" or not isinstance(mixture, Mapping) or value is None:
            continue
        weights.append(dict(mixture))
        losses.append(float(value))
        trials.append(row["trial_id"])
    return weights, losses, trials


@dataclass
class RegMixResult:
    """The proxy search's outcome: the fit, the chosen weights and `Mixture`, and the trials it fit."""

    fit: MixtureFit
    weights: Dict[str, float]
    predicted: float
    mixture: Mixture
    trials: List[Tuple[str, Dict[str, float], float]]  # (trial id, weights, loss)

    def report(self) -> str:
        lines = [self.fit.describe(), f"chosen mixture {self.weights} (predicted {self.predicted:.4g})"]
        best = min(self.trials, key=lambda t: t[2])
        lines.append(f"best trial {best[0]}: {best[1]} ({best[2]:.4g})")
        return "\n".join(lines)


def regmix_search(
    result: Any,
    base: Mixture,
    *,
    metric: Optional[str] = None,
    model: str = "gp",
    folds: int = 5,
    candidates: int = 20_000,
    concentration: float = 1.0,
    top: int = 100,
    seed: int = 0,
) -> RegMixResult:
    """Fit a sweep's trials (``metric``: the sweep's, a loss to minimise) and choose the mixture for ``base``."""
    metric = metric or result.metric
    if metric == result.metric and result.mode != "min":
        raise ValueError(f"regmix_search minimises {metric!r}, but the sweep maximised it: pass a loss metric.")
    weights, losses, trials = trial_points(result, metric)
    fit = fit_mixture_regression(weights, losses, names=base.names, model=model, folds=folds, seed=seed)
    chosen, predicted = best_mixture(fit, candidates=candidates, concentration=concentration, top=top, seed=seed)
    return RegMixResult(
        fit=fit,
        weights=chosen,
        predicted=predicted,
        mixture=trial_mixture(base, chosen),
        trials=list(zip(trials, weights, losses)),
    )


def write_mixture_config(mixture: Mixture, url: str, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """Write ``mixture.to_dict()`` to ``url`` (YAML for ``.yaml``/``.yml``, else JSON); return ``url``."""
    from raytrain_events.storage.fs import resolve, write_bytes_atomic

    data = mixture.to_dict()
    if url.endswith((".yaml", ".yml")):
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = json.dumps(data, indent=1)
    fs, path = resolve(url, dict(storage_options or {}))
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    write_bytes_atomic(fs, path, text.encode())
    return url


def read_mixture_config(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Mixture:
    """The `Mixture` a stages config (from `write_mixture_config`, or written by hand) holds."""
    from raytrain_events.storage.fs import read_bytes, resolve

    fs, path = resolve(url, dict(storage_options or {}))
    text = read_bytes(fs, path).decode()
    if url.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise MixtureError(f"{url} holds {type(data).__name__}, not a mixture: expected sources and stages.")
    return Mixture.from_dict(data)
