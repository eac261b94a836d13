"""Mixture weights as a search space: Dirichlet samples on the simplex, a grid of named mixtures.

A trial's ``config["mixture"]`` is a plain ``{source: weight}`` dict (weights >= 0, summing to 1,
rounded to `DIGITS` decimals so the same mixture reads the same in every table). The trial trains
on the sweep's base `Mixture` with its first stage's weights replaced by these (`trial_mixture`);
a later stage of the base mixture keeps its own weights. The results table shows the weights as
``mixture/<source>`` columns.

Example (8 trials, each a Dirichlet draw; the same ``seed`` gives the same 8 mixtures)::

    sweep(trainer=dict(mixture=mixture, datasets={"web": ..., "code": ..., "math": ...}, ...),
          param_space={"mixture": mixture_space(mixture, concentration=1.0, num_samples=8, seed=0)}, ...)

``mixture_space`` without ``num_samples`` is a Tune `Domain` sampled by Tune's own random state
(``sweep(num_samples=N, search_alg=BasicVariantGenerator(random_state=0))`` seeds it): Tune copies
the search space for each sample, so a domain cannot keep a seeded stream of its own.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
from ray.tune.search.sample import BaseSampler, Domain

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.tune.sets import space_choices

__all__ = [
    "mixture_space",
    "mixture_grid",
    "Simplex",
    "trial_mixture",
    "base_mixture",
    "check_mixture_choice",
    "normalize_weights",
    "DIGITS",
]

#: Decimals a sampled weight keeps (1e-4 of an epoch's rows: below one batch for most runs).
DIGITS = 4


def normalize_weights(weights: Mapping[str, float], names: Sequence[str]) -> Dict[str, float]:
    """``weights`` over ``names`` (a missing name is 0), summing to 1 and rounded to `DIGITS` decimals."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise MixtureError(
            f"The mixture weights name {unknown}, which are not sources of the sweep's mixture (sources: "
            f"{list(names)}): check the spelling, or add the source to trainer['mixture'] and trainer['datasets']."
        )
    values = []
    for name in names:
        value = weights.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise MixtureError(f"Weight {value!r} of source {name!r} must be a finite number >= 0.")
        values.append(float(value))
    total = sum(values)
    if total <= 0:
        raise MixtureError(f"The mixture weights {dict(weights)!r} sum to 0: give at least one source a weight > 0.")
    rounded = [round(v / total, DIGITS) for v in values]
    largest = values.index(max(values))
    # The largest takes the rounding's remainder: the weights sum to 1 exactly (in DIGITS decimals), so
    # normalising them again gives them back unchanged.
    rounded[largest] = round(1.0 - sum(r for i, r in enumerate(rounded) if i != largest), DIGITS)
    return dict(zip(names, rounded))


def _alphas(names: Sequence[str], concentration: Union[float, Mapping[str, float]]) -> List[float]:
    if isinstance(concentration, Mapping):
        unknown = sorted(set(concentration) - set(names))
        if unknown:
            raise MixtureError(
                f"concentration names {unknown}, which are not sources (sources: {list(names)}): "
                "give one value per source name, or one number for all."
            )
        missing = [n for n in names if n not in concentration]
        if missing:
            raise MixtureError(f"concentration has no value for {missing}: give one per source, or one number.")
        alphas = [concentration[n] for n in names]
    else:
        alphas = [concentration] * len(names)
    for name, alpha in zip(names, alphas):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise MixtureError(
                f"concentration {alpha!r} (source {name!r}) must be a finite number > 0: 1.0 samples the simplex "
                "uniformly, below 1 favours mixtures dominated by few sources, above 1 mixtures near equal weights."
            )
    return [float(a) for a in alphas]


def _names(mixture: Union[Mixture, Sequence[str]]) -> List[str]:
    if isinstance(mixture, Mixture):
        return list(mixture.names)
    if isinstance(mixture, (list, tuple)) and mixture and all(isinstance(n, str) for n in mixture):
        return sorted(mixture)  # a Mixture orders its sources by name: so do its weights
    raise TypeError(f"Pass the sweep's Mixture (or its source names), got {mixture!r}.")


class _DirichletSampler(BaseSampler):
    def sample(self, domain: Any, config: Any = None, size: int = 1, random_state: Any = None) -> Any:
        if random_state is None or isinstance(random_state, int):  # Domain.sample passes Tune's wrapped rng
            random_state = np.random.default_rng(random_state)
        draws = [domain.draw(random_state) for _ in range(size)]
        return draws if size > 1 else draws[0]


class Simplex(Domain):
    """Tune ``Domain`` of mixture weights: a Dirichlet over the sources (built by `mixture_space`)."""

    default_sampler_cls = _DirichletSampler

    def __init__(self, names: Sequence[str], alphas: Sequence[float]) -> None:
        self.names, self.alphas = list(names), list(alphas)

    def draw(self, rng: Any) -> Dict[str, float]:
        """One weight dict from ``rng`` (a numpy ``Generator``/``RandomState`` or Tune's wrapper of one)."""
        return normalize_weights(dict(zip(self.names, rng.dirichlet(self.alphas))), self.names)

    def is_valid(self, value: Any) -> bool:
        try:
            normalize_weights(value, self.names)
        except (MixtureError, TypeError, AttributeError):
            return False
        return True

    @property
    def domain_str(self) -> str:
        return f"Dirichlet({dict(zip(self.names, self.alphas))})"


def mixture_space(
    mixture: Union[Mixture, Sequence[str]],
    *,
    concentration: Union[float, Mapping[str, float]] = 1.0,
    num_samples: Optional[int] = None,
    seed: int = 0,
) -> Any:
    """Mixture weights sampled from a Dirichlet over ``mixture``'s sources, for ``param_space["mixture"]``.

    ``concentration``: the Dirichlet's alpha, one number or one per source (1.0: uniform over the
    simplex). With ``num_samples`` the draws are made now from ``seed`` and returned as a
    ``tune.grid_search`` of that many weight dicts (reproducible, listed in the sweep's config);
    without it, a Tune ``Domain`` that Tune samples once per trial (``sweep(num_samples=...)``).
    """
    names = _names(mixture)
    alphas = _alphas(names, concentration)
    domain = Simplex(names, alphas)
    if num_samples is None:
        return domain
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"mixture_space(num_samples={num_samples!r}) must be an int >= 1 (or None for a Domain).")
    from ray import tune

    rng = np.random.default_rng(seed)
    return tune.grid_search([domain.draw(rng) for _ in range(num_samples)])


def mixture_grid(mixtures: Union[Sequence[Any], Mapping[str, Any]], *, names: Optional[Sequence[str]] = None) -> Any:
    """``tune.grid_search`` over given mixtures: weight dicts, `Mixture` objects (their first stage), or a
    ``{label: weights}`` dict. ``names``: the sweep's source names, to check the weights now."""
    from ray import tune

    items = list(mixtures.values()) if isinstance(mixtures, Mapping) else list(mixtures)
    if not items:
        raise ValueError("mixture_grid needs at least one mixture: [{'web': 0.7, 'code': 0.3}, ...].")
    weights = []
    for item in items:
        if isinstance(item, Mixture):
            first = next(iter((item.stages or {}).values()))
            item_names = list(item.names)
            weights.append(normalize_weights(_proportions(first, item, "mixture_grid"), names or item_names))
        elif isinstance(item, Mapping):
            weights.append(normalize_weights(item, names or sorted(item)))
        else:
            raise TypeError(f"mixture_grid takes weight dicts or Mixture objects, got {item!r}.")
    return tune.grid_search(weights)


def _proportions(stage: Mapping[str, Any], mixture: Mixture, where: str) -> Dict[str, float]:
    if any(isinstance(v, Mapping) for v in stage.values()):
        raise MixtureError(
            f"{where}: the first stage of {mixture.to_dict()} is in repeat/choose amounts; a searched mixture "
            "replaces proportions: give its first stage as proportions."
        )
    return {k: float(v) for k, v in stage.items()}


def base_mixture(spec: Any) -> Optional[Mixture]:
    """The sweep's base `Mixture` (``RunSpec.data.mixture``, a `Mixture` or its dict), or None without one."""
    mixture = spec.data.mixture
    if mixture is None or isinstance(mixture, Mixture):
        return mixture
    if isinstance(mixture, Mapping):
        return Mixture.from_dict(mixture)
    raise TypeError(f"trainer['mixture'] must be a Mixture or its dict, got {type(mixture).__name__}.")


def check_mixture_choice(base: Optional[Mixture], value: Any) -> None:
    """Refuse, before Ray starts, a searched mixture the base run cannot train."""
    if base is None:
        raise MixtureError(
            "param_space['mixture'] searches the data mixture, but the sweep's trainer has none: "
            "pass trainer={'mixture': Mixture(...), 'datasets': {<source>: ds, ...}, ...}."
        )
    if isinstance(value, Simplex):
        names = getattr(value, "names", [])
        if sorted(names) != sorted(base.names):
            raise MixtureError(
                f"mixture_space is over sources {names}, the sweep's mixture has {list(base.names)}: "
                "build it with mixture_space(<the trainer's mixture>, ...)."
            )
        return
    for choice in space_choices(value):
        if not isinstance(choice, Mapping):
            raise MixtureError(f"param_space['mixture'] holds {choice!r}: give {{source: weight}} dicts.")
        trial_mixture(base, choice)


def trial_mixture(base: Mixture, weights: Mapping[str, float]) -> Mixture:
    """``base`` with its first stage's weights replaced by ``weights`` (the trial's ``config["mixture"]``)."""
    assert base.stages is not None
    stages = {k: dict(v) for k, v in base.stages.items()}
    first = next(iter(stages))
    _proportions(stages[first], base, "param_space['mixture']")
    stages[first] = normalize_weights(weights, base.names)
    return Mixture(sources=base.sources, stages=stages, epoch_size=base.epoch_size)
