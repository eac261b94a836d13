"""PBT over mixture weights: explore on the simplex, the copy's mixture, and each trial's mixture over time.

PBT's exploit hands a bottom trial a top trial's config and checkpoint; `MixtureExplore` (the
``custom_explore_fn`` `pbt_scheduler(mixture=...)` gives Tune's PBT) then perturbs the copied
``config["mixture"]`` on the simplex: with probability ``resample_probability`` a fresh Dirichlet
draw, otherwise each weight times ``exp(scale * N(0, 1))``, renormalised (a weight of 0 stays 0:
a source the donor did not train on is not brought back by noise, only by a resample).

`copy_mixture` is the mixture the copy's run trains on: the donor run's whole mixture (from the
pointer: its stages and earlier switches) switched at the donor checkpoint's global sample to the
explored weights (`Mixture.switched`). Every position before the switch keeps the donor's order,
so the copy loads the donor's checkpoint (exact Timestamp, per-source counts and cursors) and each
source continues from its cursor: every row still at most once per epoch.

`mixture_segments` turns a trial's initial mixture and its lineage (`SweepResult` rows'
``lineage``: each copy's donor, counters and mixtures) into ``[(from, to, weights, trial)]``: which
mixture the trial's model trained on over which global samples, through the donors it copied.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.tune.simplex import normalize_weights

__all__ = ["MixtureExplore", "perturb_weights", "copy_mixture", "mixture_segments", "check_mixture_pbt"]


def perturb_weights(weights: Mapping[str, float], rng: Any, *, scale: float = 0.3) -> Dict[str, float]:
    """``weights`` times ``exp(scale * N(0, 1))`` each, renormalised onto the simplex (zeros stay zero)."""
    names = list(weights)
    noisy = {n: float(weights[n]) * math.exp(scale * float(rng.standard_normal())) for n in names}
    return normalize_weights(noisy, names)


class MixtureExplore:
    """PBT's ``custom_explore_fn``: perturb (or resample) ``config["mixture"]`` on the simplex.

    ``space``: the `mixture_space(...)` domain resamples come from; ``then``: a user's own
    ``custom_explore_fn``, applied after. Seeded: the same sequence of explores draws the same noise.
    """

    def __init__(
        self,
        space: Any,
        *,
        scale: float = 0.3,
        resample_probability: float = 0.25,
        seed: Optional[int] = None,
        then: Any = None,
    ) -> None:
        import numpy as np

        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise MixtureError(
                f"mixture_scale={scale!r} must be a finite number > 0 (the log-normal noise's sigma: 0.3 moves "
                "a weight by about 30%)."
            )
        if not (isinstance(resample_probability, (int, float)) and 0 <= resample_probability <= 1):
            raise ValueError(f"resample_probability={resample_probability!r} must be in [0, 1].")
        if not hasattr(space, "draw"):
            raise TypeError(f"pbt_scheduler(mixture=...) takes mixture_space(<the trainer's mixture>), got {space!r}.")
        self.space, self.scale, self.resample_probability, self.then = space, scale, resample_probability, then
        self.rng = np.random.default_rng(seed)

    def __call__(self, config: Dict[str, Any]) -> Dict[str, Any]:
        current = config.get("mixture")
        if isinstance(current, Mapping):
            if self.rng.random() < self.resample_probability:
                config["mixture"] = self.space.draw(self.rng)
            else:
                config["mixture"] = perturb_weights(
                    {n: current.get(n, 0.0) for n in self.space.names}, self.rng, scale=self.scale
                )
        return self.then(config) if self.then is not None else config


def check_mixture_pbt(scheduler: Any, param_space: Mapping[str, Any], base: Optional[Mixture]) -> None:
    """Refuse, before Ray starts, PBT over the mixture in a sweep that cannot run it.

    ``scheduler``: the sweep's scheduler (`pbt_scheduler(mixture=...)` marks the one it builds with
    ``raytrain_mixture_explore``); ``base``: the trainer's mixture.
    Refused: no ``param_space["mixture"]`` (the trials' ``config`` has no weights to perturb, so
    PBT would explore nothing, silently), and a base mixture with more than one stage (a copy
    switches the weights at the donor checkpoint's sample, which may come before a later stage's
    start: the switch and that stage cannot both hold).
    """
    if getattr(scheduler, "raytrain_mixture_explore", None) is None:
        return
    if "mixture" not in param_space:
        raise MixtureError(
            "pbt_scheduler(mixture=...) perturbs each trial's config['mixture'], but param_space has no 'mixture', "
            "so PBT would explore nothing: pass param_space={'mixture': mixture_space(<the trainer's mixture>, "
            "num_samples=<population>)} (the population's starting weights)."
        )
    if base is not None and len(base.stages or {}) > 1:
        raise MixtureError(
            f"PBT over the mixture needs a one-stage base mixture; trainer['mixture'] has stages at "
            f"{list(base.stages or {})}. A copy switches the weights at the donor checkpoint's sample, which can "
            "come before a later stage starts. Give trainer['mixture'] one stage (PBT's explores are the "
            "schedule), or search whole staged mixtures without PBT (param_space={'mixture': mixture_grid([...])})."
        )


def copy_mixture(
    donor: Mixture,
    at_sample: int,
    weights: Optional[Mapping[str, float]],
    donor_weights: Optional[Mapping[str, float]] = None,
) -> Mixture:
    """The mixture a PBT copy trains on: ``donor`` (the donor run's mixture) with ``weights`` from ``at_sample`` on.

    ``at_sample``: the donor checkpoint's global sample. Weights equal to ``donor_weights`` (PBT
    explored other keys only) or None keep the donor's mixture unchanged.
    """
    if weights is None:
        return donor
    explored = normalize_weights(weights, donor.names)
    if donor_weights is not None and explored == normalize_weights(donor_weights, donor.names):
        return donor
    return donor.switched(int(at_sample), explored)


Segment = Tuple[int, Optional[int], Dict[str, float], str]


def mixture_segments(
    trial_id: str,
    initial: Mapping[str, float],
    lineage: Sequence[Mapping[str, Any]],
    *,
    end: Optional[int] = None,
    unit: str = "sample",
) -> List[Segment]:
    """``[(from, to, weights, trained by)]`` in global ``unit`` counts: the mixture of each stretch of training.

    Before a copy at ``counters[unit] = t`` the model is the donor's: its stretch up to ``t`` is
    the donor's mixture (``from_mixture``), trained by the donor (``copied_trial``); from ``t`` on
    the trial trains on its explored ``mixture``. ``to`` of the last stretch is ``end`` (or None).
    """
    segments: List[Segment] = [(0, None, dict(initial), trial_id)]
    for step in lineage:
        at = int((step.get("counters") or {}).get(unit, 0))
        donor = str(step.get("copied_trial", "?"))
        from_mixture = step.get("from_mixture")
        kept = [s for s in segments if s[0] < at]  # the trial's own stretches the copy replaced are dropped
        if isinstance(from_mixture, Mapping):
            kept = [(0, at, dict(from_mixture), donor)]  # the model up to `at` is the donor's
        segments = [*kept, (at, None, dict(step.get("mixture") or {}), trial_id)]
    closed = [(a, segments[i + 1][0], w, who) for i, (a, _, w, who) in enumerate(segments[:-1])]
    last = segments[-1]
    return [*closed, (last[0], end, last[2], last[3])]
