"""Held-out tasks for the mixture search's bench and tests: proxies that take milliseconds, with a known best.

* `ConflictTask`: the issue's task. Three sources of points in 8 dimensions, each labelled by its
  own linear rule (the rules conflict), and a held-out set drawn 0.7/0.2/0.1 from the three. A proxy
  really trains: a linear classifier, SGD (lr 0.5, batch 32, one pass over ``samples`` rows drawn
  from the mixture, as ``examples/tune_mixture.py``'s proxies), its held-out cross-entropy is the
  loss; ``seed`` changes the rows drawn and the model's init (the proxy's noise is real).
* `SyntheticTask`: five sources, a smooth loss with a known minimum at ``best`` (a weighted
  log-ratio: every source helps up to its share in ``best``, a missing one costs the most) plus
  Gaussian noise of ``noise`` per proxy: benches the search logic without training.

Both are callables ``task(weights, seed) -> loss`` with ``names`` and ``best``; `best_loss` is the
best achievable held-out loss (the noise-free loss at ``best`` for the synthetic task; the mean
over seeds of the minimum found by a dense search for the conflict task: `ConflictTask.best_loss`).
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Sequence, Tuple

import numpy as np
import torch

__all__ = ["ConflictTask", "SyntheticTask"]


class ConflictTask:
    names: Tuple[str, ...] = ("a", "b", "c")
    target: Dict[str, float] = {"a": 0.7, "b": 0.2, "c": 0.1}
    dim = 8

    def __init__(self, samples: int = 512, eval_rows: int = 2000) -> None:
        self.samples = samples
        self.rules = np.random.default_rng(1234).normal(size=(len(self.names), self.dim))
        rng = np.random.default_rng(1)
        parts = [self._rows(s, int(eval_rows * f), rng) for s, f in self.target.items()]
        self.eval_x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        self.eval_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        self.best = dict(self.target)

    def _rows(self, source: str, n: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(n, self.dim)).astype(np.float32)
        return x, (x @ self.rules[self.names.index(source)] > 0).astype(np.int64)

    def __call__(self, weights: Mapping[str, float], seed: int = 0) -> float:
        rng = np.random.default_rng([seed, 7])
        p = np.asarray([float(weights.get(n, 0.0)) for n in self.names])
        counts = rng.multinomial(self.samples, p / p.sum())
        parts = [self._rows(s, int(c), rng) for s, c in zip(self.names, counts)]
        order = rng.permutation(self.samples)
        x = torch.from_numpy(np.concatenate([q[0] for q in parts])[order])
        y = torch.from_numpy(np.concatenate([q[1] for q in parts])[order])
        generator = torch.Generator().manual_seed(seed)
        model = torch.nn.Linear(self.dim, 2, bias=False)
        with torch.no_grad():
            model.weight.normal_(0, 0.3, generator=generator)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for i in range(0, self.samples, 32):
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 32]), y[i : i + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(self.eval_x), self.eval_y))

    def mean_loss(self, weights: Mapping[str, float], seeds: Sequence[int] = (100, 101, 102, 103)) -> float:
        """The held-out loss over fresh seeds (not the proxies' own): what a choice really gives."""
        return float(np.mean([self(weights, s) for s in seeds]))


class SyntheticTask:
    names: Tuple[str, ...] = ("s0", "s1", "s2", "s3", "s4")

    def __init__(self, noise: float = 0.01, best: Mapping[str, float] | None = None) -> None:
        self.noise = noise
        self.best = dict(best or {"s0": 0.45, "s1": 0.25, "s2": 0.15, "s3": 0.1, "s4": 0.05})
        self.gain = {"s0": 0.3, "s1": 0.5, "s2": 0.4, "s3": 0.6, "s4": 0.2}  # how much each source's share matters

    def true_loss(self, weights: Mapping[str, float]) -> float:
        total = sum(float(weights.get(n, 0.0)) for n in self.names)
        loss = 1.0
        for n in self.names:
            w, b = float(weights.get(n, 0.0)) / total, self.best[n]
            loss += self.gain[n] * b * (math.log(b / (w + 0.01 * b)) + (w + 0.01 * b) / b - 1)  # >= 0, 0 at w = b
        return loss

    @property
    def best_loss(self) -> float:
        return self.true_loss(self.best)

    def __call__(self, weights: Mapping[str, float], seed: int = 0) -> float:
        key = tuple(round(float(weights.get(n, 0.0)), 4) for n in self.names)
        rng = np.random.default_rng([seed, *(int(v * 1e4) for v in key)])
        return self.true_loss(weights) + float(rng.normal(0, self.noise))

    def mean_loss(self, weights: Mapping[str, float]) -> float:
        return self.true_loss(weights)
