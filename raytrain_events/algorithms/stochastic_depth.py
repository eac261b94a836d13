"""`StochasticDepth`: randomly drop the residual branches of blocks during training.

For a residual block ``y = x + f(x)`` you mark the branch ``f`` (the module whose output is
added to the skip connection): ``mark_residual_branch(block.branch)``, or pass
``target_modules=`` as module classes or name patterns (``"layers.*.branch"``). At ``INIT`` a
forward hook is put on each marked branch. In training mode the hook multiplies the branch
output by a random mask that is 0 with probability ``p`` and ``1 / (1 - p)`` otherwise, so the
expected output is unchanged and evaluation uses every branch as is. ``mode="sample"`` draws
the mask per sample (Composer's "sample" mode), ``mode="batch"`` once per batch. With
``drop_distribution="linear"`` the i-th of L branches uses ``p_i = drop_rate * (i + 1) / L``
(deeper blocks drop more); ``drop_warmup`` ramps every rate up from 0 over the start of the run.
Huang et al., 2016; Composer's ``StochasticDepth``.

Hooks keep parameter names unchanged, so checkpoints load with or without this algorithm.
"""

from __future__ import annotations

import fnmatch
from typing import Any, List, Sequence, Union

import torch

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.core.time import Time, TimeUnit, ensure_time

__all__ = ["StochasticDepth", "mark_residual_branch", "drop_path"]

_MARK = "_raytrain_residual_branch"


def mark_residual_branch(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` as the residual branch of a block (returns it, so it can wrap a constructor)."""
    setattr(module, _MARK, True)
    return module


def drop_path(output: torch.Tensor, p: float, mode: str = "sample") -> torch.Tensor:
    """``output * mask`` with ``mask`` 0 with probability ``p``, else ``1 / (1 - p)``."""
    if p <= 0.0:
        return output
    if p >= 1.0:
        return output * 0.0
    shape = (output.shape[0],) + (1,) * (output.dim() - 1) if mode == "sample" else (1,) * output.dim()
    keep = torch.empty(shape, dtype=output.dtype, device=output.device).bernoulli_(1.0 - p)
    return output * keep.div_(1.0 - p)


class _Hook:
    """The forward hook of one branch; reads its current drop rate from the algorithm."""

    def __init__(self, owner: StochasticDepth, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not module.training or not isinstance(output, torch.Tensor):
            return output
        return drop_path(output, self.owner.current_rates[self.index], self.owner.mode)


@register_algorithm("stochastic_depth")
class StochasticDepth(Algorithm):
    """Drop marked residual branches at random while training.

    Example::

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.branch = mark_residual_branch(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
            def forward(self, x):
                return x + self.branch(x)

        Trainer(..., algorithms=[StochasticDepth(drop_rate=0.2)])
    """

    def __init__(
        self,
        drop_rate: float = 0.2,
        drop_distribution: str = "linear",
        mode: str = "sample",
        target_modules: Union[None, str, type, Sequence[Union[str, type]]] = None,
        drop_warmup: Union[str, Time] = "0dur",
    ) -> None:
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate={drop_rate!r} must be in [0, 1), like 0.2.")
        if drop_distribution not in ("linear", "uniform"):
            raise ValueError(f"drop_distribution={drop_distribution!r} must be 'linear' or 'uniform'.")
        if mode not in ("sample", "batch"):
            raise ValueError(f"mode={mode!r} must be 'sample' or 'batch'.")
        self.drop_rate, self.drop_distribution, self.mode = float(drop_rate), drop_distribution, mode
        if target_modules is None or isinstance(target_modules, (str, type)):
            target_modules = [] if target_modules is None else [target_modules]
        self.target_modules = list(target_modules)
        self.drop_warmup = ensure_time(drop_warmup, TimeUnit.DURATION)
        if self.drop_warmup.unit != TimeUnit.DURATION:
            raise ValueError(f"drop_warmup={drop_warmup!r} must be a fraction of the run, like '0.1dur'.")
        self.rates: List[float] = []
        self.current_rates: List[float] = []
        self.branch_names: List[str] = []
        self._handles: List[Any] = []

    def match(self, event: Event, state) -> bool:
        if event == Event.INIT:
            return True
        return event == Event.BATCH_START and self.drop_warmup.value > 0

    def apply(self, event: Event, state, logger) -> None:
        if event == Event.INIT:
            self._install(state.model)
        else:
            ramp = min(1.0, float(state.get_elapsed_duration().value) / self.drop_warmup.value)
            self.current_rates = [rate * ramp for rate in self.rates]
        return None

    def _is_target(self, name: str, module: torch.nn.Module) -> bool:
        if getattr(module, _MARK, False):
            return True
        for target in self.target_modules:
            if isinstance(target, type) and isinstance(module, target):
                return True
            if isinstance(target, str) and name and fnmatch.fnmatchcase(name, target):
                return True
        return False

    def _install(self, model: torch.nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        branches = [(n, m) for n, m in model.named_modules() if self._is_target(n, m)]
        if not branches:
            raise ValueError(
                "StochasticDepth found no residual branches: mark them with "
                "raytrain_events.algorithms.mark_residual_branch(module) or pass target_modules=[BlockBranchClass] "
                "or name patterns like 'layers.*.branch'."
            )
        count = len(branches)
        if self.drop_distribution == "linear":
            self.rates = [self.drop_rate * (i + 1) / count for i in range(count)]
        else:
            self.rates = [self.drop_rate] * count
        self.current_rates = [0.0] * count if self.drop_warmup.value > 0 else list(self.rates)
        self.branch_names = [n for n, _ in branches]
        self._handles = [m.register_forward_hook(_Hook(self, i)) for i, (_, m) in enumerate(branches)]

    def __repr__(self) -> str:
        return f"StochasticDepth(drop_rate={self.drop_rate}, drop_distribution={self.drop_distribution!r}, mode={self.mode!r})"
