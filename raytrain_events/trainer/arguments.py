"""`Trainer`'s arguments checked before any work starts: each wrong input fails with its problem and fix.

What is checked here would otherwise train wrongly in silence or fail late, deep in torch:
a single object where a list is expected, an optimizer class or factory where an instance is,
an optimizer over tensors the model does not own (the model would never change), a scheduler
built on another optimizer (the learning rate would never be scheduled), the same algorithm
twice (applied twice), a logger named by a string, a device this build of torch does not have.
Each check runs once, at construction; nothing here runs per batch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch

from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.callback import Callback
from raytrain_events.core.logger import LoggerDestination

if TYPE_CHECKING:
    from raytrain_events.dist import Dist

__all__ = [
    "agreed_run_name",
    "check_arguments",
    "check_autoresume_named",
    "check_list",
    "check_device",
    "check_optimizers",
    "check_schedulers",
]

log = logging.getLogger(__name__)

_KINDS = {
    "algorithms": (Algorithm, "raytrain_events.algorithms, e.g. [LabelSmoothing(0.1)]"),
    "callbacks": (Callback, "raytrain_events.callbacks, e.g. [SpeedMonitor()]"),
    "loggers": (
        LoggerDestination,
        "raytrain_events.loggers, e.g. [FileLogger('log.txt')] or [WandBLogger(project=...)]",
    ),
}


def check_arguments(
    model: torch.nn.Module, optimizers: Any, device: Any, lists: Tuple[Any, Any, Any]
) -> Tuple[List[Algorithm], List[Callback], List[LoggerDestination]]:
    """The Trainer's object arguments checked; ``lists`` (algorithms, callbacks, loggers) returned as lists."""
    algorithms, callbacks, loggers = lists
    checked = check_list("algorithms", algorithms), check_list("callbacks", callbacks), check_list("loggers", loggers)
    check_optimizers(optimizers, model)
    check_device(device)
    return checked


def agreed_run_name(run_name: Optional[str], dist: Dist, checkpoint: Any) -> str:
    """The run's name: ``run_name`` checked (one folder name), or a fresh unique one shared by every rank.

    Without a name, ``autoresume`` has nothing to continue (each job's default name is new), so
    it is refused unless the checkpoint config names its ``save_folder``.
    """
    # why here: defers fsspec until this runs
    from raytrain_events.storage.exp_dir import check_run_name, fresh_run_name

    if run_name is not None:
        return check_run_name(run_name)
    check_autoresume_named(
        checkpoint,
        named=bool(getattr(checkpoint, "save_folder", None)),
        fix="name the run, Trainer(run_name='my-run', ...), with the same name in every job that continues it (or "
        "set CheckpointConfig(save_folder=...)).",
    )
    name = fresh_run_name()
    return str(dist.all_gather_object(name)[0]) if dist.is_distributed else name  # rank 0's, on every rank


def check_autoresume_named(checkpoint: Any, *, named: bool, fix: str) -> None:
    """Refuse ``CheckpointConfig(autoresume=True)`` in a run that is not ``named`` (the one owner of this refusal:
    `Trainer` and `RayTrainer` both call it, each with its ``fix``): a run without a name gets a fresh one, so
    there is nothing to resume."""
    if named or not getattr(checkpoint, "autoresume", False):
        return
    raise ValueError(
        "CheckpointConfig(autoresume=True) without a run_name: a job without one gets a fresh name "
        "(run-<date>-<time>-<hex>), so there is nothing to resume and two jobs never share checkpoints. Fix: " + fix
    )


def check_list(what: str, value: Any) -> List[Any]:
    """``algorithms``, ``callbacks`` or ``loggers``: a list (or tuple) of instances of their base class."""
    base, example = _KINDS[what]
    if isinstance(value, base) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{what}={value!r} must be a list of {base.__name__} objects. Fix: {what}=[{value!r}], "
            f"like {what} from {example}."
        )
    for item in value:
        if isinstance(item, base):
            continue
        if isinstance(item, type) and issubclass(item, base):
            fix = f"pass an instance: {item.__name__}(...)"
        elif isinstance(item, str) and what == "algorithms":
            fix = f"build it: build_algorithm({item!r}) from raytrain_events.algorithms, or {example}"
        elif isinstance(item, str):
            fix = f"build it: {what} take objects, not names ({example})"
        elif what == "algorithms":
            fix = "subclass raytrain_events.Algorithm (or build one by name with raytrain_events.algorithms.build_algorithm)"
        else:
            fix = f"subclass {base.__module__}.{base.__name__}"
        article = "an" if base.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{item!r} in {what} is not {article} {base.__name__}: {fix}.")
    if what == "algorithms":
        seen: dict[type, Any] = {}
        for item in value:
            if type(item) in seen:
                raise ValueError(
                    f"algorithms lists {type(item).__name__} twice ({seen[type(item)]!r} and {item!r}): it would be "
                    "applied twice per event. Fix: keep one of them (with the settings you want)."
                )
            seen[type(item)] = item
    return list(value)


def check_device(device: Any) -> None:
    """Refuse a device this build of torch (or this machine) has none of."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}). Fix: device='cpu' or 'cuda'.") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible CUDA device"
        raise ValueError(
            f"device={device!r}, but this process has {build} (torch {torch.__version__}). Fix: leave device unset "
            "(the Trainer picks the GPU where there is one) or pass device='cpu'; install a CUDA build of torch "
            "on a GPU machine to train there."
        )


def check_optimizers(optimizers: Any, model: torch.nn.Module) -> None:
    """Optimizer objects (not a class or factory) over the model's own parameters."""
    if optimizers is None:
        return
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for optimizer in items:
        if isinstance(optimizer, torch.optim.Optimizer):
            continue
        if isinstance(optimizer, type):
            fix = f"build it: optimizers={optimizer.__name__}(model.parameters(), lr=...)"
        elif callable(optimizer):
            fix = (
                "call the factory yourself: optimizers=make_optimizer(model) (Trainer takes optimizer objects; "
                "factories are RayTrainer's, which calls them on each worker)"
            )
        else:
            fix = "optimizers=torch.optim.AdamW(model.parameters(), lr=...)"
        raise TypeError(f"optimizers={optimizer!r} is not a torch.optim.Optimizer. Fix: {fix}.")
    owned = {id(p) for p in model.parameters()}
    for optimizer in items:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = [p for p in params if id(p) not in owned]
        if params and len(foreign) == len(params):
            raise ValueError(
                f"{type(optimizer).__name__} optimizes {len(params)} tensors, none of which is a parameter of the "
                "model: training would never change the model. Fix: build the optimizer from the model you pass, "
                "e.g. torch.optim.AdamW(model.parameters(), lr=...), after any change to the model."
            )
        if foreign:
            log.warning(
                "%s optimizes %d of its %d tensors that are not parameters of the model: those are updated but never "
                "used by it. Build the optimizer from model.parameters() unless that is what you want.",
                type(optimizer).__name__,
                len(foreign),
                len(params),
            )


def check_schedulers(schedulers: Sequence[Any], optimizers: Sequence[Any]) -> None:
    """LR scheduler objects (not classes) bound to one of the optimizers the loop steps."""
    for scheduler in schedulers:
        if isinstance(scheduler, type):
            raise TypeError(
                f"schedulers={scheduler.__name__} is a class. Fix: build it on your optimizer, e.g. "
                f"schedulers={scheduler.__name__}(optimizer, ...), or pass a raytrain_events.schedulers schedule."
            )
        bound = getattr(scheduler, "optimizer", None)
        if isinstance(bound, torch.optim.Optimizer) and not any(bound is o for o in optimizers):
            raise ValueError(
                f"{type(scheduler).__name__} was built on a {type(bound).__name__} that is not one of the Trainer's "
                "optimizers, so the learning rate would never be scheduled. Fix: build the scheduler on the "
                "optimizer you pass as optimizers= (the same object)."
            )
