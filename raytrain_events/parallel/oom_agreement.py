"""Out-of-memory agreement inside FSDP's forward and backward, for ``grad_accum="auto"`` under FSDP.

Why: FSDP all-gathers each unit's parameters before its forward and backward and reduce-scatters
its gradients after backward. A rank that runs out of device memory in the middle of forward
leaves; its peers go on to the next unit's all-gather and would wait there forever. So every rank
checks, right before each of FSDP's collectives, whether any rank has failed: one small all-reduce
of a flag (host memory, the `Dist` counter group). A rank that failed joins the very next check
with its flag set (`OOMAgreement.fail`), every peer sees it there and stops too (`PeerOutOfMemory`),
and no rank is left inside a collective the others never join.

The checks (each an all-reduce of one int64 over the ranks), per FSDP unit and microbatch:

- forward: before the unit's all-gather (a forward pre-hook ahead of FSDP's own);
- backward: before the unit's pre-backward all-gather (a gradient hook on the unit's outputs,
  registered ahead of FSDP's), and before its reduce-scatter (an autograd function on the unit's
  inputs, whose backward runs just before FSDP's post-backward), plus one before FSDP's final
  backward callback (which reduce-scatters the units whose inputs needed no gradient);
- and one per attempt at the batch, after its last microbatch (`OOMAgreement.finish`).

An error between two checks is agreed at the next one. An error inside FSDP's own collective code
(for example while allocating an all-gather's output) happens after the peers entered that
collective and cannot be agreed; the process group's timeout ends that wait.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from raytrain_events._torch_compat import autograd_engine
from raytrain_events.dist import Dist

__all__ = ["OOMAgreement", "PeerOutOfMemory", "check_fsdp_config"]


def check_fsdp_config(config: Any) -> None:
    """Refuse what auto microbatching cannot retry under this `FSDPConfig` (ValueError with the fix).

    With ``reduce_dtype`` other than the parameters' dtype, FSDP keeps the gradients of ``no_sync``
    microbatches in a buffer of its own, which a failed attempt could not drop.
    """
    reduce_dtype = config.dtype("reduce_dtype")
    if reduce_dtype is not None and reduce_dtype != (config.dtype("param_dtype") or torch.float32):
        raise ValueError(
            f"grad_accum='auto' with FSDPConfig(reduce_dtype={config.reduce_dtype!r}) (other than param_dtype="
            f"{config.param_dtype!r}): FSDP accumulates microbatch gradients in its own reduce-dtype buffer, which "
            "a retry after an out-of-memory error cannot discard. Fix: drop reduce_dtype (or set it to param_dtype), "
            "or pass a fixed grad_accum."
        )


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of device memory in this attempt at the batch: stop it here too."""


class _CheckBeforeReduce(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs the check right before FSDP's reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, check: Callable[[], None], *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.check = check
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.check()
        return (None, *grads)


def _grad_tensors(value: Any, out: List[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _grad_tensors(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _grad_tensors(item, out)


def _replace(value: Any, new: Any) -> Any:
    """``value`` with each grad-requiring tensor taken in order from the iterator ``new``."""
    if isinstance(value, torch.Tensor):
        return next(new) if value.requires_grad else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_replace(item, new) for item in value)
    if isinstance(value, list):
        return [_replace(item, new) for item in value]
    if isinstance(value, dict):
        return {key: _replace(item, new) for key, item in value.items()}
    return value


class OOMAgreement:
    """The flag checks in every FSDP unit of ``model`` (installed once, after sharding).

    ``active`` turns them on for an attempt at a batch (`begin`); outside (evaluation, prediction)
    the hooks cost one attribute read. ``checks`` counts the all-reduces this rank ran.
    """

    def __init__(self, model: torch.nn.Module, dist: Dist) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.dist = dist
        self.root = model
        self.active = False
        self.failed = False  # this rank raised in this attempt (its flag goes to the next check)
        self.checks = 0
        self._callback_queued = False
        # Each unit's unsharded parameters (seen while FSDP has them in place, in forward): their
        # .grad holds what no_sync microbatches accumulated, which FSDP's reset does not drop.
        self._unsharded: Dict[int, List[torch.Tensor]] = {}
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if model not in self.units:
            raise ValueError(f"{type(model).__name__} is not sharded: OOMAgreement needs fully_shard applied first.")
        for unit in self.units:
            unit.register_forward_pre_hook(self._before_forward, prepend=True)  # ahead of FSDP's all-gather
            unit.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True)  # after FSDP's post-backward hook
            unit.register_forward_hook(self._hook_outputs, prepend=True)  # ahead of FSDP's pre-backward hook

    # ------------------------------------------------------------------ the check
    def check(self) -> None:
        """One agreement point: raise `PeerOutOfMemory` if any rank has failed in this attempt."""
        self.checks += 1
        failed = self.dist.sum_ints_async([0]).wait()[0]
        if failed:
            raise PeerOutOfMemory(f"{failed} rank(s) ran out of device memory in this attempt at the batch")

    def begin(self) -> None:
        """Before an attempt at a batch: checks on, nobody failed yet."""
        self.active, self.failed, self._callback_queued = True, False, False

    def fail(self) -> None:
        """This rank raised: join the peers' next check with the flag set (once per attempt)."""
        if self.active and not self.failed:
            self.failed = True
            self.checks += 1
            self.dist.sum_ints_async([1]).wait()

    def finish(self) -> None:
        """After the attempt's last microbatch (no error here): the last check, then checks off."""
        try:
            self.check()
        finally:
            self.active = False

    def reset(self) -> None:
        """After a failed attempt: FSDP's per-iteration state reset (unsharded buffers freed), the
        gradients of earlier ``no_sync`` microbatches dropped, checks off."""
        self.active = False
        self.root.reset_iter_state()  # type: ignore[operator]
        for params in self._unsharded.values():
            for param in params:
                param.grad = None

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.active and torch.is_grad_enabled():
            self.check()

    def _wrap_inputs(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Optional[Any]:
        if not (self.active and torch.is_grad_enabled()):
            return None
        if id(module) not in self._unsharded:  # FSDP's pre-forward just put the unsharded ones in place
            from torch.distributed.tensor import DTensor  # here: 0.3-0.8 s to import, FSDP runs only

            self._unsharded[id(module)] = [p for p in module.parameters() if not isinstance(p, DTensor)]
        tensors: List[torch.Tensor] = []
        _grad_tensors((args, kwargs), tensors)
        if not tensors:
            return None
        wrapped = _CheckBeforeReduce.apply(self.check, *tensors)
        new_args, new_kwargs = _replace((args, kwargs), iter(wrapped))
        return new_args, new_kwargs

    def _hook_outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not (self.active and torch.is_grad_enabled()):
            return
        tensors: List[torch.Tensor] = []
        _grad_tensors(output, tensors)
        for tensor in tensors:
            tensor.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._callback_queued:  # ahead of FSDP's final callback (queued by its pre-backward hook)
            self._callback_queued = True
            autograd_engine.queue_callback(self._final_check)
        self.check()
        return grad

    def _final_check(self) -> None:
        self._callback_queued = False
        if self.active:
            self.check()
