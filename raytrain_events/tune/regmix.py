"""RegMix-style proxy search: fit eval loss as a function of the mixture weights, choose weights the fit stands behind.

After a sweep of short trials with sampled mixtures (`mixture_space`), `fit_mixture_regression`
(`raytrain_events.tune.mixture_fit`: a Gaussian process, Bayesian ridge or RegMix's LightGBM,
each with its uncertainty, the noise from repeats, cross-validated) fits each trial's target loss
over its weights, and `best_mixture` (`raytrain_events.tune.acquisition.choose_mixture`) picks the
candidate with the best criterion (by default the mean plus one std, inside a trust region around
the proxies: a choice the fit's own uncertainty supports, never an extrapolation far from every
proxy). `regmix_search` runs both on a `SweepResult` and returns the chosen `Mixture`;
`write_mixture_config` writes it as a stages config (``Mixture.to_dict()``, YAML or JSON) that a
full run reads unchanged with `read_mixture_config` / ``Mixture.from_dict``.

The fit and the search are pure functions of their inputs (and a seed): no Ray, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.storage.fs import read_bytes, resolve, write_bytes_atomic
from raytrain_events.tune.acquisition import MixtureChoice, TrustRegion, check_choice_args, choose_mixture
from raytrain_events.tune.mixture_fit import MixtureFit, check_model, fit_mixture_regression
from raytrain_events.tune.simplex import trial_mixture

#: `choose_mixture` under the name the first round gave it.
best_mixture = choose_mixture

__all__ = [
    "MixtureFit",
    "MixtureChoice",
    "RegMixResult",
    "fit_mixture_regression",
    "best_mixture",
    "regmix_search",
    "trial_points",
    "write_mixture_config",
    "read_mixture_config",
]


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
    choice: MixtureChoice
    mixture: Mixture
    trials: List[Tuple[str, Dict[str, float], float]]  # (trial id, weights, loss)

    @property
    def weights(self) -> Dict[str, float]:
        return self.choice.weights

    @property
    def predicted(self) -> float:
        return self.choice.predicted

    def report(self) -> str:
        lines = [self.fit.describe(), self.choice.describe()]
        best = min(self.trials, key=lambda t: t[2])
        lines.append(f"best trial {best[0]}: {best[1]} ({best[2]:.4g})")
        return "\n".join(lines)


def regmix_search(
    result: Any,
    base: Mixture,
    *,
    metric: Optional[str] = None,
    model: str = "gp",
    criterion: str = "ucb",
    kappa: float = 1.0,
    trust_region: TrustRegion = "auto",
    noise: Optional[float] = None,
    inputs: str = "shares",
    folds: int = 5,
    candidates: int = 20_000,
    concentration: float = 1.0,
    top: int = 1,
    seed: int = 0,
) -> RegMixResult:
    """Fit a sweep's trials (``metric``: the sweep's, a loss to minimise) and choose the mixture for ``base``.

    ``model``, ``noise``, ``inputs``: `fit_mixture_regression`'s; ``criterion``, ``kappa``, ``trust_region``,
    ``candidates``, ``concentration``, ``top``: `choose_mixture`'s.
    """
    check_model(model)
    check_choice_args(criterion, kappa, trust_region)
    metric = metric or result.metric
    if metric == result.metric and result.mode != "min":
        raise ValueError(f"regmix_search minimises {metric!r}, but the sweep maximised it: pass a loss metric.")
    weights, losses, trials = trial_points(result, metric)
    fit = fit_mixture_regression(
        weights, losses, names=base.names, model=model, folds=folds, noise=noise, inputs=inputs, seed=seed
    )
    choice = choose_mixture(
        fit,
        criterion=criterion,
        kappa=kappa,
        trust_region=trust_region,
        candidates=candidates,
        concentration=concentration,
        top=top,
        seed=seed,
    )
    return RegMixResult(
        fit=fit,
        choice=choice,
        mixture=trial_mixture(base, choice.weights),
        trials=list(zip(trials, weights, losses)),
    )


def write_mixture_config(mixture: Mixture, url: str, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """Write ``mixture.to_dict()`` to ``url`` (YAML for ``.yaml``/``.yml``, else JSON); return ``url``."""

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
