"""Refine the mixture in rounds: a Ray Tune `Searcher` that places each batch of proxies where the fit says.

``sweep(search_alg=MixtureSearcher(mixture, initial=8, batch=4), num_samples=16, ...)`` runs the
proxies as trials of one sweep: the first ``initial`` trials fill the simplex (``design="space-filling"``,
the default: uniform weights first, the mixture a search replaces, then a scrambled Halton sequence
through the Dirichlet's quantiles, spread evenly; ``"mixed"``: the same with every other point leaning to the
corners, through a Dirichlet of `CORNER_SHARE` of the concentration; ``"dirichlet"``: seeded Dirichlet draws, as
`mixture_space`); once every trial placed so far has ended, the searcher fits the losses they
reported (`fit_mixture_regression`) and places the next round's trials (``batch``: one size for
every round, or the rounds' sizes in order, the last one repeated: ``batch=(4, 2, 1)`` runs 4
trials at once first and refines one at a time late, when each proxy's loss moves the next most) where ``criterion`` scores best
(`choose_mixture`'s candidates and scores; by default the lower confidence bound ``mean - 0.5 * std``)
among candidates inside the trust region around the ``incumbents`` proxies the fit ranks best (their
predicted mean; ``trust_region="auto"``, the default: the proxies' median nearest-neighbour distance,
so the region shrinks as the proxies close in; ``"adaptive"``: TuRBO's rule, the radius doubled after
two rounds in a row that improved on the best loss and halved after two that did not; None: the whole
simplex), greedily, each next point at least ``spread`` (total-variation distance) from the points
chosen before it in the batch, so one batch does not pile onto one spot. ``explore=k`` keeps ``k`` of
each round's slots (never all of them) for the criterion's best over the whole simplex. It ends after
``max_trials`` trials (Tune's ``num_samples`` caps it as well). After the sweep, `regmix_search` (or
`choose_mixture` on `MixtureSearcher.fit`) chooses the full run's mixture from all the trials.

Why a region around the incumbents: over the whole simplex, expected improvement on 5 sources
and a dozen proxies goes where the fit knows least, the simplex's corners (a source near 0), so
most rounds were spent on proxies worse than uniform weights; near the best proxies it refines
(TuRBO's trust region). Why the defaults (`bench/mixture_search.py`, docs/tune.md): the space-filling
first batch and the optimistic but mean-led bound (kappa 0.5, where expected improvement chased the
fit's uncertainty) reached the 5-source task's goal with 16 proxies where the old ones needed 20, and
lifted the 3-source conflict task from 0.09-0.12 of the gap at 12-24 proxies to 0.02-0.04; an
exploring slot and the adaptive radius did not do better there (kept as options).

The placement is a pure function of the trials' losses and ``seed`` (each round's candidates drawn
from ``seed`` and the round's number), and the searcher's state (the points placed, which trial got
which, the losses reported) is what Tune saves with the experiment (`save`/`restore`, a pickle
Tune writes atomically): a sweep stopped mid-round and resumed re-runs that round's unfinished
trials and places the same next batch.

A trial that fails (or reports no metric) counts as ended but is not fitted. The searcher asks
Tune to wait (``suggest`` returns None) while a round is unfinished: batches are synchronous.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from ray.tune.search import Searcher

from raytrain_events.core.mixture import Mixture
from raytrain_events.tune.acquisition import TrustRegion, auto_radius, candidates_near, check_choice_args, scores
from raytrain_events.tune.mixture_fit import MixtureFit, check_model, fit_mixture_regression, weight_matrix
from raytrain_events.tune.simplex import _alphas, _names, normalize_weights

__all__ = ["MixtureSearcher", "DESIGNS", "DEFAULT_DESIGN", "first_design"]

#: The first batch's designs: ``"space-filling"`` and ``"dirichlet"`` (`first_design`).
DESIGNS = ("space-filling", "dirichlet", "mixed")
#: ``design="mixed"``: the corner-leaning points' concentration, as a share of ``concentration`` (RegMix's draws).
CORNER_SHARE = 0.5
#: The first batch's design when none is given.
DEFAULT_DESIGN = "space-filling"


def _count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"MixtureSearcher({name}={value!r}) must be an int >= {least}.")
    return value


def _rounds(batch: Any) -> Union[int, Tuple[int, ...]]:
    """``batch`` checked: one round size, or the sizes of the rounds in order (the last one repeats)."""
    if isinstance(batch, (list, tuple)):
        if not batch:
            raise ValueError("MixtureSearcher(batch=()) names no round: give a size, or sizes such as (4, 2, 1).")
        return tuple(_count(b, f"batch[{i}]", 1) for i, b in enumerate(batch))
    return _count(batch, "batch", 1)


def first_design(design: str, alphas: List[float], count: int, seed: int) -> np.ndarray:
    """The first batch's ``count`` weight rows. ``"dirichlet"``: seeded draws from Dirichlet(``alphas``).
    ``"space-filling"``: uniform weights (the mixture a search replaces: the choice never has to do worse), then a
    scrambled Halton sequence through the Gamma quantiles of ``alphas``: Dirichlet draws whose uniforms are spread
    evenly, so no two of a few proxies land close together and no region is left without one. ``"mixed"``: the
    same, every other Halton point (from the second) through the quantiles of ``CORNER_SHARE * alphas`` instead:
    corner-leaning, as RegMix's small-concentration draws (a source or two near 0, where the best mixture lies when
    a source hurts), still spread apart by the Halton sequence."""
    if design == "dirichlet":
        return np.random.default_rng(seed).dirichlet(alphas, count)
    from scipy.stats import gamma, qmc  # why here: scipy comes with the mixsearch extra (as mixture_fit's)

    u = qmc.Halton(d=len(alphas), scramble=True, seed=np.random.default_rng([seed, 0])).random(count - 1)
    shape = np.tile(np.asarray(alphas, dtype=float), (count - 1, 1))
    if design == "mixed":
        shape[1::2] *= CORNER_SHARE  # the 3rd, 5th, ... rows (after uniform weights and one space-filling point)
    g = np.maximum(gamma.ppf(np.clip(u, 1e-9, 1 - 1e-9), a=shape), 1e-12)
    rows = g / g.sum(axis=1, keepdims=True)
    return np.vstack([np.full((1, len(alphas)), 1.0 / len(alphas)), rows])


class MixtureSearcher(Searcher):
    """Tune search algorithm over ``config["mixture"]``: a space-filling first batch, then batches placed by the fit."""

    def __init__(
        self,
        mixture: Union[Mixture, List[str]],
        *,
        initial: int = 8,
        batch: Union[int, Sequence[int]] = 4,
        max_trials: int = 16,
        model: str = "gp",
        inputs: str = "shares",
        criterion: str = "lcb",
        kappa: float = 0.5,
        trust_region: TrustRegion = "auto",
        incumbents: int = 3,
        explore: int = 0,
        design: str = DEFAULT_DESIGN,
        spread: Optional[float] = None,
        concentration: float = 1.0,
        candidates: int = 4000,
        metric: Optional[str] = None,
        mode: str = "min",
        seed: int = 0,
    ) -> None:
        if mode != "min":
            raise ValueError(f"MixtureSearcher(mode={mode!r}): it minimises a loss; pass mode='min' and a loss metric.")
        super().__init__(metric=metric, mode=mode)
        self.names = _names(mixture)
        self.alphas = _alphas(self.names, concentration)
        self.initial = _count(initial, "initial", 4)  # the fit needs 4 points
        self.batch = _rounds(batch)
        self.max_trials = _count(max_trials, "max_trials", self.initial)
        self.model = check_model(model)
        if inputs not in ("shares", "log"):
            raise ValueError(f"MixtureSearcher(inputs={inputs!r}): use 'shares' or 'log' (fit_mixture_regression's).")
        self.inputs = inputs
        check_choice_args(criterion, kappa, None if trust_region == "adaptive" else trust_region)
        self.criterion, self.kappa, self.trust_region = criterion, float(kappa), trust_region
        self.incumbents = _count(incumbents, "incumbents", 1)
        self.explore = _count(explore, "explore", 0)
        if design not in DESIGNS:
            raise ValueError(
                f"MixtureSearcher(design={design!r}): use 'space-filling' (uniform weights first, then a scrambled "
                "Halton sequence through the Dirichlet's quantiles), 'mixed' (the same, every other point leaning to "
                "the corners) or 'dirichlet' (seeded Dirichlet draws)."
            )
        self.design = design
        if spread is not None and not (isinstance(spread, (int, float)) and 0 <= spread <= 1):
            raise ValueError(f"MixtureSearcher(spread={spread!r}) must be a distance in [0, 1] (or None: automatic).")
        self.spread, self.candidates, self.seed = spread, _count(candidates, "candidates", 1), int(seed)
        self.placed: List[Dict[str, float]] = []  # every point placed, in order
        self.assigned: Dict[str, int] = {}  # trial id -> index into placed
        self.losses: Dict[int, Optional[float]] = {}  # index -> loss (None: failed) once its trial ended
        self.rounds = 0
        self.ends: List[int] = [self.initial]  # len(placed) after each round (the first batch: initial)
        self.placed = [
            normalize_weights(dict(zip(self.names, map(float, d))), self.names)
            for d in first_design(self.design, self.alphas, self.initial, self.seed)
        ]
        self.fit: Optional[MixtureFit] = None

    # -- Tune's interface ----------------------------------------------------------------------

    def set_search_properties(self, metric: Optional[str], mode: Optional[str], config: Dict, **spec: Any) -> bool:
        if mode not in (None, "min"):
            raise ValueError(f"MixtureSearcher minimises a loss, but the sweep's mode is {mode!r}: use mode='min'.")
        self._metric = self._metric or metric
        return True

    def suggest(self, trial_id: str) -> Optional[Dict[str, Any]]:
        if trial_id in self.assigned:  # Tune asked again for the same trial: the same point
            return {"mixture": dict(self.placed[self.assigned[trial_id]])}
        if len(self.assigned) >= self.max_trials:
            return Searcher.FINISHED
        if len(self.assigned) == len(self.placed):  # every placed point has its trial: the round must end first
            if len(self.losses) < len(self.assigned):
                return None
            self._place_next()
            if len(self.assigned) == len(self.placed):  # nothing to fit (every trial failed): stop
                return Searcher.FINISHED
        index = len(self.assigned)
        self.assigned[trial_id] = index
        return {"mixture": dict(self.placed[index])}

    def on_trial_complete(self, trial_id: str, result: Optional[Dict] = None, error: bool = False) -> None:
        if trial_id not in self.assigned:
            return
        value = None if error or not result else result.get(self.metric)
        self.losses[self.assigned[trial_id]] = None if value is None else float(value)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.get_state(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.set_state(pickle.load(f))

    def get_state(self) -> Dict[str, Any]:
        keys = ("names", "alphas", "initial", "batch", "max_trials", "model", "inputs", "criterion", "kappa")
        keys += ("trust_region", "incumbents", "explore", "design")
        state = {k: getattr(self, k) for k in keys}
        state.update(spread=self.spread, candidates=self.candidates, seed=self.seed, rounds=self.rounds, ends=self.ends)
        state.update(placed=self.placed, assigned=self.assigned, losses=self.losses, metric=self._metric)
        return {k: pickle.loads(pickle.dumps(v)) for k, v in state.items()}

    def set_state(self, state: Dict[str, Any]) -> None:
        metric = state.pop("metric", None)
        self.__dict__.update(state)
        self._metric = self._metric or metric
        self.fit = None

    # -- placing a round -------------------------------------------------------------------------

    def observed(self) -> List[Dict[str, Any]]:
        """The ended trials with a loss: ``{"trial_id", "mixture", "loss"}`` in placement order."""
        by_index = {i: t for t, i in self.assigned.items()}
        return [
            {"trial_id": by_index[i], "mixture": self.placed[i], "loss": loss}
            for i, loss in sorted(self.losses.items())
            if loss is not None
        ]

    def _place_next(self) -> None:
        done = self.observed()
        if len(done) < 4:
            return
        self.fit = fit_mixture_regression(
            [d["mixture"] for d in done],
            [d["loss"] for d in done],
            names=self.names,
            model=self.model,
            inputs=self.inputs,
            folds=0,
            seed=self.seed,
        )
        self.rounds += 1
        rng = np.random.default_rng([self.seed, self.rounds])
        radius = self._radius()
        centers = self.fit.points
        if radius is not None:  # the region around the incumbents: the proxies the fit ranks best
            order = np.argsort(self.fit.predict_rows(self.fit.points)[0], kind="stable")
            centers = self.fit.points[order[: self.incumbents]]
        concentration = float(np.mean(self.alphas))
        pool = candidates_near(centers, radius, self.candidates, concentration, rng)
        spread = self.spread if self.spread is not None else auto_radius(self.fit.points) / 2
        sizes = self.batch if isinstance(self.batch, tuple) else (self.batch,)
        count = min(sizes[min(self.rounds, len(sizes)) - 1], self.max_trials - len(self.placed))
        explore = min(self.explore, count - 1) if radius is not None else 0  # a round keeps one slot in the region
        chosen = self._best_apart(pool, count - explore, spread, [])
        if explore:  # the whole simplex's best by the criterion: the region may have closed in on the wrong spot
            wide = candidates_near(self.fit.points, None, self.candidates, concentration, rng)
            chosen = self._best_apart(wide, count, spread, chosen)
        self.placed += [normalize_weights(dict(zip(self.names, map(float, c))), self.names) for c in chosen]
        self.ends.append(len(self.placed))

    def _radius(self) -> Optional[float]:
        """This round's trust region: "auto": the proxies' spacing now; "adaptive": TuRBO's rule replayed over the
        rounds so far (a pure function of their losses): it starts at the first batch's spacing, two rounds in a
        row whose best loss beat the best before them (by 1e-3 of it) double it (up to 1), two in a row that did
        not halve it, and below 0.02 it starts over."""
        assert self.fit is not None
        if self.trust_region != "adaptive":
            return auto_radius(self.fit.points) if self.trust_region == "auto" else self.trust_region  # type: ignore[return-value]
        first = weight_matrix(self.placed[: self.initial], self.names)
        start = radius = auto_radius(first)
        best = min((v for i, v in self.losses.items() if i < self.initial and v is not None), default=np.inf)
        wins = fails = 0
        for lo, hi in zip(self.ends, self.ends[1:]):
            got = min((v for i, v in self.losses.items() if lo <= i < hi and v is not None), default=np.inf)
            if got < best - 1e-3 * abs(best):
                wins, fails = wins + 1, 0
            else:
                wins, fails = 0, fails + 1
            best = min(best, got)
            if wins == 2:
                radius, wins = min(2 * radius, 1.0), 0
            elif fails == 2:
                radius, fails = radius / 2, 0
                if radius < 0.02:
                    radius = start
        return radius

    def _best_apart(self, pool: np.ndarray, count: int, spread: float, chosen: List[np.ndarray]) -> List[np.ndarray]:
        """``chosen`` plus the best-scored candidates of ``pool``, greedily, each ``spread`` from those before it."""
        assert self.fit is not None
        score, _, _ = scores(self.fit, pool, self.criterion, self.kappa)
        chosen = list(chosen)
        for i in np.argsort(score, kind="stable"):
            if len(chosen) >= count:
                break
            if all(0.5 * np.abs(pool[i] - c).sum() >= spread for c in chosen):
                chosen.append(pool[i])
        return chosen
