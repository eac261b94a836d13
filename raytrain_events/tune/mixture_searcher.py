"""Refine the mixture in rounds: a Ray Tune `Searcher` that places each batch of proxies where the fit says.

``sweep(search_alg=MixtureSearcher(mixture, initial=8, batch=4), num_samples=16, ...)`` runs the
proxies as trials of one sweep: the first ``initial`` trials get seeded Dirichlet draws over the
sources (as `mixture_space`); once every trial placed so far has ended, the searcher fits the
losses they reported (`fit_mixture_regression`) and places the next ``batch`` where ``criterion``
scores best (`choose_mixture`'s candidates and scores; expected improvement by default) among
candidates inside the trust region around the ``incumbents`` proxies the fit ranks best (their
predicted mean; ``trust_region="auto"``, the default: the proxies' median nearest-neighbour
distance, so the region shrinks as the proxies close in; None: the whole simplex), greedily,
each next point at least ``spread`` (total-variation distance) from the points chosen before it in
the batch, so one batch does not pile onto one spot. It ends after ``max_trials`` trials (Tune's
``num_samples`` caps it as well). After the sweep, `regmix_search` (or `choose_mixture` on
`MixtureSearcher.fit`) chooses the full run's mixture from all the trials.

Why a region around the incumbents: over the whole simplex, expected improvement on 5 sources
and a dozen proxies goes where the fit knows least, the simplex's corners (a source near 0), so
most rounds were spent on proxies worse than uniform weights; near the best proxies it refines
(TuRBO's trust region, with its radius read from the proxies' spacing instead of kept as state).
Measured in `bench/mixture_search.py` (docs/tune.md).

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
from typing import Any, Dict, List, Optional, Union

import numpy as np
from ray.tune.search import Searcher

from raytrain_events.core.mixture import Mixture
from raytrain_events.tune.acquisition import TrustRegion, auto_radius, candidates_near, check_choice_args, scores
from raytrain_events.tune.mixture_fit import MixtureFit, check_model, fit_mixture_regression
from raytrain_events.tune.simplex import _alphas, _names, normalize_weights

__all__ = ["MixtureSearcher"]


def _count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"MixtureSearcher({name}={value!r}) must be an int >= {least}.")
    return value


class MixtureSearcher(Searcher):
    """Tune search algorithm over ``config["mixture"]``: seeded draws first, then batches placed by the fit."""

    def __init__(
        self,
        mixture: Union[Mixture, List[str]],
        *,
        initial: int = 8,
        batch: int = 4,
        max_trials: int = 16,
        model: str = "gp",
        inputs: str = "shares",
        criterion: str = "ei",
        kappa: float = 1.0,
        trust_region: TrustRegion = "auto",
        incumbents: int = 3,
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
        self.batch = _count(batch, "batch", 1)
        self.max_trials = _count(max_trials, "max_trials", self.initial)
        self.model = check_model(model)
        if inputs not in ("shares", "log"):
            raise ValueError(f"MixtureSearcher(inputs={inputs!r}): use 'shares' or 'log' (fit_mixture_regression's).")
        self.inputs = inputs
        check_choice_args(criterion, kappa, trust_region)
        self.criterion, self.kappa, self.trust_region = criterion, float(kappa), trust_region
        self.incumbents = _count(incumbents, "incumbents", 1)
        if spread is not None and not (isinstance(spread, (int, float)) and 0 <= spread <= 1):
            raise ValueError(f"MixtureSearcher(spread={spread!r}) must be a distance in [0, 1] (or None: automatic).")
        self.spread, self.candidates, self.seed = spread, _count(candidates, "candidates", 1), int(seed)
        self.placed: List[Dict[str, float]] = []  # every point placed, in order
        self.assigned: Dict[str, int] = {}  # trial id -> index into placed
        self.losses: Dict[int, Optional[float]] = {}  # index -> loss (None: failed) once its trial ended
        self.rounds = 0
        rng = np.random.default_rng(self.seed)
        self.placed = [
            normalize_weights(dict(zip(self.names, d)), self.names) for d in rng.dirichlet(self.alphas, self.initial)
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
        keys += ("trust_region", "incumbents")
        state = {k: getattr(self, k) for k in keys}
        state.update(spread=self.spread, candidates=self.candidates, seed=self.seed, rounds=self.rounds)
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
        radius = auto_radius(self.fit.points) if self.trust_region == "auto" else self.trust_region
        centers = self.fit.points
        if radius is not None:  # the region around the incumbents: the proxies the fit ranks best
            order = np.argsort(self.fit.predict_rows(self.fit.points)[0], kind="stable")
            centers = self.fit.points[order[: self.incumbents]]
        pool = candidates_near(centers, radius, self.candidates, float(np.mean(self.alphas)), rng)
        score, _, _ = scores(self.fit, pool, self.criterion, self.kappa)
        spread = self.spread if self.spread is not None else auto_radius(self.fit.points) / 2
        chosen: List[np.ndarray] = []
        count = min(self.batch, self.max_trials - len(self.placed))
        for i in np.argsort(score, kind="stable"):
            if all(0.5 * np.abs(pool[i] - c).sum() >= spread for c in chosen):
                chosen.append(pool[i])
            if len(chosen) == count:
                break
        self.placed += [normalize_weights(dict(zip(self.names, map(float, c))), self.names) for c in chosen]
