"""`SAM`: sharpness-aware minimization (Foret et al., 2021), Composer's ``SAM`` algorithm.

Each step first moves the weights up the gradient to ``w + e(w)``, ``e(w) = rho * g / ||g||``,
computes the gradient there, moves back to ``w``, and lets the base optimizer step with that
gradient: the update descends the worst-case loss in a ``rho`` ball around ``w``. The second
gradient needs a second forward/backward of the batch, so `SAMOptimizer` has ``uses_closure``
and the loop calls ``step(closure)`` (see `raytrain_events.trainer.stepping`): the closure re-runs
the batch's microbatches (grad accumulation) and, under DDP, all-reduces the gradient again, so
``||g||`` and the update are the same on every rank. ``interval=k`` does the SAM step on every
k-th batch only (a plain step otherwise), halving the extra cost for k=2.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["SAM", "SAMOptimizer"]


class SAMOptimizer(torch.optim.Optimizer):
    """Wraps ``base_optimizer``; shares its parameter groups (LR schedulers keep working) and state."""

    uses_closure = True

    def __init__(
        self, base_optimizer: torch.optim.Optimizer, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1
    ):
        if not rho > 0:
            raise ValueError(f"SAM rho={rho!r} must be > 0 (the radius of the perturbation).")
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"SAM interval={interval!r} must be an integer >= 1.")
        self.base_optimizer = base_optimizer
        self.rho, self.epsilon, self.interval = float(rho), float(epsilon), interval
        self._steps = 0
        super().__init__(base_optimizer.param_groups, base_optimizer.defaults)
        self.param_groups = base_optimizer.param_groups  # the same dicts: schedulers set the base's LR
        self.state = base_optimizer.state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Perturb, re-evaluate through ``closure``, restore, and step the base optimizer."""
        if closure is None:
            raise ValueError("SAMOptimizer.step needs a closure that recomputes the loss and gradients.")
        self._steps += 1
        if self._steps % self.interval:
            return self.base_optimizer.step()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return self.base_optimizer.step()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        scale = self.rho / (norm + self.epsilon)
        perturbations: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for p in params:
            e = p.grad * scale.to(p.grad.dtype)
            p.add_(e)
            perturbations.append((p, e))
        loss = closure()  # gradients at w + e(w)
        for p, e in perturbations:
            p.sub_(e)
        self.base_optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.base_optimizer.state_dict()  # checkpoints hold the base optimizer's state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.base_optimizer.load_state_dict(state_dict)


@register_algorithm("sam")
class SAM(Algorithm):
    """Wrap every optimizer in `SAMOptimizer` at INIT.

    Example::

        Trainer(..., optimizers=torch.optim.SGD(model.parameters(), lr=0.1), algorithms=[SAM(rho=0.05)])
    """

    def __init__(self, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1) -> None:
        SAMOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0), rho, epsilon, interval)  # validate
        self.rho, self.epsilon, self.interval = rho, epsilon, interval
        self._wrapped: List[SAMOptimizer] = []  # the optimizers this algorithm wrapped at INIT

    def match(self, event: Event, state: Any) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        state.optimizers = [
            o if isinstance(o, SAMOptimizer) else SAMOptimizer(o, self.rho, self.epsilon, self.interval)
            for o in state.optimizers
        ]
        self._wrapped = [o for o in state.optimizers if isinstance(o, SAMOptimizer)]

    def state_dict(self) -> Dict[str, Any]:
        """The step counts, so a resumed run does its SAM steps (every ``interval``-th) on the same batches."""
        return {"steps": [o._steps for o in self._wrapped]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for optimizer, steps in zip(self._wrapped, state.get("steps", [])):
            optimizer._steps = int(steps)
