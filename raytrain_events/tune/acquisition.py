"""Choosing weights through a fit: candidates on the simplex, a trust region, and a criterion with the uncertainty.

`choose_mixture` scores candidate weights through a `MixtureFit` (its mean ``m`` and uncertainty
``s`` at each) by a criterion, lower is better:

* ``"ucb"`` (the default for a final choice): ``m + kappa * s``, the loss the fit is confident the
  mixture stays under: a point far from every proxy, where the fit knows little, scores badly;
* ``"lcb"``: ``m - kappa * s``, optimistic: where a new proxy could find a lower loss (placing proxies);
* ``"ei"``: minus the expected improvement below the best loss the fit predicts at a proxy (placing proxies);
* ``"mean"``: ``m`` alone (the old rule: it trusts the fit's mean anywhere, even where it extrapolates).

Candidates are Dirichlet draws over the simplex plus draws around each proxy; by default only those
inside the trust region count: within total-variation distance ``trust_region`` (half the L1 distance
of the weights, 0 to 1) of a proxy. ``"auto"`` sets it to the proxies' median nearest-neighbour distance;
None lifts it (the whole simplex). The `MixtureChoice` reports the chosen weights' prediction and
uncertainty, the nearest proxy and its observed loss.

Pure functions of their inputs and a seed: no Ray, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from raytrain_events.core.mixture import MixtureError
from raytrain_events.tune.mixture_fit import MixtureFit
from raytrain_events.tune.simplex import normalize_weights

__all__ = ["CRITERIA", "MixtureChoice", "choose_mixture", "check_choice_args", "scores", "tv_distance", "auto_radius"]

CRITERIA = ("ucb", "lcb", "ei", "mean")
TrustRegion = Union[None, str, float]


def check_choice_args(criterion: Any, kappa: Any, trust_region: Any) -> None:
    """Refuse an unknown criterion, a negative kappa or a trust region outside (0, 1], naming the fix."""
    if criterion not in CRITERIA:
        raise ValueError(
            f"criterion={criterion!r}: use 'ucb' (mean + kappa*std: a choice the fit is sure of), 'lcb' "
            "(mean - kappa*std: optimistic, for placing proxies), 'ei' (expected improvement) or 'mean'."
        )
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not math.isfinite(kappa) or kappa < 0:
        raise ValueError(f"kappa={kappa!r} must be a number >= 0 (the std's weight in 'ucb'/'lcb'; 1.0 by default).")
    if trust_region is None or trust_region == "auto":
        return
    ok = not isinstance(trust_region, bool) and isinstance(trust_region, (int, float)) and 0 < trust_region <= 1
    if not ok:
        raise ValueError(
            f"trust_region={trust_region!r} must be a total-variation distance in (0, 1] (e.g. 0.1: within 10% of the "
            "weight moved from a proxy), 'auto' (the proxies' spacing) or None (the whole simplex); 0 leaves no "
            "mixture but the proxies themselves: pick the best proxy instead."
        )


def tv_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Total-variation distance between each row of ``a`` and each row of ``b`` (a len(a) x len(b) matrix)."""
    return 0.5 * np.abs(a[:, None, :] - b[None, :, :]).sum(axis=2)


def auto_radius(points: np.ndarray) -> float:
    """The median distance from each distinct proxy to its nearest other one (how densely the proxies cover)."""
    unique = np.unique(np.round(points, 4), axis=0)
    if len(unique) < 2:
        return 0.05
    d = tv_distance(unique, unique)
    np.fill_diagonal(d, np.inf)
    return float(np.clip(np.median(d.min(axis=1)), 0.02, 1.0))


def scores(fit: MixtureFit, x: np.ndarray, criterion: str, kappa: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(score, mean, std) of each candidate row: lower scores are better."""
    from scipy.stats import norm

    mean, std = fit.predict_rows(x)
    if criterion == "mean":
        return mean, mean, std
    if criterion == "ucb":
        return mean + kappa * std, mean, std
    if criterion == "lcb":
        return mean - kappa * std, mean, std
    best = float(np.min(fit.predict_rows(fit.points)[0]))  # noisy EI: the best the fit predicts at a proxy
    safe = np.maximum(std, 1e-12)
    z = (best - mean) / safe
    ei = (best - mean) * norm.cdf(z) + safe * norm.pdf(z)
    return -ei, mean, std


def candidates_near(
    points: np.ndarray, radius: Optional[float], count: int, concentration: float, rng: np.random.Generator
) -> np.ndarray:
    """Dirichlet draws over the simplex (all of them without a radius, else those within it of a proxy) plus
    draws inside each proxy's ball: ``(1 - t) p + t d``, ``d`` a Dirichlet draw and ``t`` uniform below the radius."""
    k = points.shape[1]
    pool = rng.dirichlet([concentration] * k, size=count)
    if radius is None:
        return pool
    pool = pool[tv_distance(pool, points).min(axis=1) <= radius]
    per = max(1, count // (2 * len(points)))
    t = rng.uniform(0, radius, size=(len(points), per, 1))
    d = rng.dirichlet([1.0] * k, size=(len(points), per))
    local = ((1 - t) * points[:, None, :] + t * d).reshape(-1, k)
    return np.vstack([pool, local, points])


@dataclass
class MixtureChoice:
    """The chosen weights, what the fit says of them, and the proxy nearest them."""

    weights: Dict[str, float]
    predicted: float  # the fit's mean at the chosen weights
    std: float  # its uncertainty there
    criterion: str
    kappa: float
    score: float
    trust_region: Optional[float]  # the radius used (None: the whole simplex)
    nearest: Dict[str, float]  # the nearest proxy's weights
    nearest_loss: float  # its observed loss (the mean over its repeats)
    nearest_distance: float  # total-variation distance to it
    considered: int  # candidates scored

    def describe(self) -> str:
        region = "the whole simplex" if self.trust_region is None else f"trust region {self.trust_region:.3g}"
        return (
            f"chosen mixture {self.weights}: predicted {self.predicted:.4g} +- {self.std:.3g} ({self.criterion}, "
            f"{region}, {self.considered} candidates); nearest proxy {self.nearest} at distance "
            f"{self.nearest_distance:.3g} observed {self.nearest_loss:.4g}"
        )


def choose_mixture(
    fit: MixtureFit,
    *,
    criterion: str = "ucb",
    kappa: float = 1.0,
    trust_region: TrustRegion = "auto",
    candidates: int = 20_000,
    concentration: float = 1.0,
    top: int = 1,
    seed: int = 0,
) -> MixtureChoice:
    """The candidate with the best ``criterion`` score (the mean of the ``top`` best, if inside the region)."""
    check_choice_args(criterion, kappa, trust_region)
    if candidates < 1 or top < 1:
        raise ValueError(f"candidates={candidates} and top={top} must be >= 1.")
    if isinstance(concentration, bool) or not isinstance(concentration, (int, float)) or not concentration > 0:
        raise MixtureError(f"concentration {concentration!r} must be > 0 (1.0 samples the simplex uniformly).")
    radius = auto_radius(fit.points) if trust_region == "auto" else trust_region
    assert radius is None or isinstance(radius, (int, float))
    rng = np.random.default_rng(seed)
    pool = candidates_near(fit.points, radius, candidates, float(concentration), rng)
    score, _, _ = scores(fit, pool, criterion, kappa)
    order = np.argsort(score, kind="stable")
    chosen = pool[order[: min(top, len(pool))]].mean(axis=0)
    if radius is not None and tv_distance(chosen[None], fit.points).min() > radius + 1e-4:
        chosen = pool[order[0]]  # the mean of the top ones left the region: the best one alone
    weights = normalize_weights({n: float(v) for n, v in zip(fit.names, chosen)}, fit.names)
    row = np.asarray([[weights[n] for n in fit.names]])
    final_score, mean, std = scores(fit, row, criterion, kappa)
    return MixtureChoice(
        weights=weights,
        predicted=float(mean[0]),
        std=float(std[0]),
        criterion=criterion,
        kappa=float(kappa),
        score=float(final_score[0]),
        trust_region=None if radius is None else float(radius),
        considered=len(pool),
        **_nearest(fit, row[0]),
    )


def _nearest(fit: MixtureFit, row: np.ndarray) -> Dict[str, Any]:
    d = tv_distance(row[None], fit.points)[0]
    i = int(np.argmin(d))
    same = np.all(np.abs(fit.points - fit.points[i]) < 1e-4, axis=1)  # its repeats
    nearest: List[float] = fit.points[i].tolist()
    return {
        "nearest": dict(zip(fit.names, (round(v, 4) for v in nearest))),
        "nearest_loss": float(fit.losses[same].mean()),
        "nearest_distance": float(d[i]),
    }
