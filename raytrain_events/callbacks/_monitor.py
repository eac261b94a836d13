"""Shared by the stoppers: reading a monitored metric and comparing values."""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Union

__all__ = ["resolve_comparator", "check_monitor_label", "read_metric"]

Comparator = Union[str, Callable[[Any, Any], Any]]


def resolve_comparator(comparator: Comparator, *, inclusive: bool) -> Callable[[float, float], bool]:
    """``"max"``/``max``/``torch.greater`` -> greater; ``"min"``/``min``/``torch.less`` -> less; else the callable.

    ``inclusive`` selects ``>=``/``<=`` (for thresholds: "reached") over ``>``/``<`` (for improvements).
    """
    name = comparator if isinstance(comparator, str) else getattr(comparator, "__name__", "")
    if comparator is max or name in ("max", "greater", "gt"):
        return operator.ge if inclusive else operator.gt
    if comparator is min or name in ("min", "less", "lt"):
        return operator.le if inclusive else operator.lt
    if callable(comparator) and not isinstance(comparator, str):
        return lambda a, b: bool(comparator(a, b))
    raise ValueError(
        f"comparator={comparator!r} is not supported: use 'max' (higher is better), 'min', or a function (a, b) -> bool."
    )


def check_monitor_label(monitor: str, state: Any, who: str) -> None:
    """Fail at FIT_START if ``monitor`` names an eval dataset (``metrics/<label>/...``) the run does not have."""
    parts = monitor.split("/")
    if len(parts) >= 3 and parts[0] == "metrics":
        labels = [e.label for e in state.evaluators]
        if not labels:
            raise ValueError(f"{who} monitors {monitor!r} but the Trainer has no eval_dataloader to compute it.")
        if parts[1] not in labels:
            raise ValueError(
                f"{who} monitors {monitor!r} but the eval datasets are {labels}: use 'metrics/<label>/<metric>'."
            )


def read_metric(monitor: str, state: Any, logger: Any, who: str) -> Optional[Any]:
    """The latest logged value of ``monitor``, None while it has not been computed yet."""
    value = logger.metrics.get(monitor)
    if value is not None:
        return value
    parts = monitor.split("/")
    if len(parts) >= 3 and parts[0] == "metrics" and parts[1] in state.eval_metrics:
        names = [f"metrics/{parts[1]}/{n}" for n in state.eval_metrics[parts[1]]]
        if names and all(n in logger.metrics for n in names):
            raise KeyError(f"{who} monitors {monitor!r}, which is not logged; eval metrics are {names}.")
    return None
