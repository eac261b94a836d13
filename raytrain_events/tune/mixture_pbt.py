"""PBT over mixture weights: explore on the simplex, and each trial's mixture over time from its lineage.

PBT's exploit hands a bottom trial a top trial's config and checkpoint; `MixtureExplore` (a
``custom_explore_fn`` for Tune's PBT) then perturbs the copied
``config["mixture"]`` on the simplex: with probability ``resample_probability`` a fresh Dirichlet
draw, otherwise each weight times ``exp(scale * N(0, 1))``, renormalised (a weight of 0 stays 0:
a source the donor did not train on is not brought back by noise, only by a resample). Not wired
into `pbt_scheduler` yet: a copy with new weights that loads the donor's checkpoint is refused by
the mixture's resume check (the checkpoint's per-source cursors are for the donor's weights); it
needs the plan to start a stage at a position from given cursors. Without it, a copy keeps the
donor's weights, stage and exact position, and `mixture_segments` shows that in the lineage.

`mixture_segments` turns a trial's initial mixture and its lineage (`SweepResult` rows'
``lineage``: each copy's donor, counters and mixtures) into ``[(from, to, weights, trial)]``: which
mixture the trial's model trained on over which global samples, through the donors it copied.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.core.mixture import MixtureError
from raytrain_events.tune.simplex import normalize_weights

__all__ = ["MixtureExplore", "perturb_weights", "mixture_segments"]


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
