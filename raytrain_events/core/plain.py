"""The one converter to plain Python data (for JSON, YAML, Ray reports, logs and config diffs).

Tensors and numpy values become Python numbers or lists, OmegaConf containers and dataclasses
become dicts, mappings and sequences are converted item by item. Pure logic: OmegaConf is only
imported when the value is one of its containers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import numbers
from typing import Any, Callable, Dict, Mapping

__all__ = ["to_python", "to_plain", "describe_value", "flatten", "is_finite_number"]


def to_python(value: Any) -> Any:
    """A one-element tensor or numpy value as a Python number; other values unchanged."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: getattr(value, "size", 1))() == 1:
        return item()
    return value


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool, not NaN or inf): a metric value a table or a plot can show."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


_SCALARS = (str, bool, int, float)  # bool before int: a bool is an int


def to_plain(value: Any, *, fallback: Callable[[Any], Any] = str, resolve: bool = True) -> Any:
    """``value`` as plain Python data: None, bool, int, float, str, lists and dicts with str keys.

    Tensors and numpy arrays/scalars go through ``tolist()``; OmegaConf containers through
    ``OmegaConf.to_container(resolve=resolve)``; objects with ``to_dict()`` (configs) through it;
    other dataclasses field by field; `Time` values become their time string. Anything else
    becomes ``fallback(value)`` (``str`` by default; ``repr`` or `describe_value` elsewhere).
    """
    if value is None:
        return None
    if isinstance(value, enum.Enum):  # a str-valued Enum (Precision) by its value, not str()'s "Precision.FP32"
        return to_plain(value.value, fallback=fallback, resolve=resolve)
    for scalar in _SCALARS:  # subclasses (IntEnum, numpy's float64) become the plain type
        if isinstance(value, scalar):
            return scalar(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return to_plain(OmegaConf.to_container(value, resolve=resolve), fallback=fallback, resolve=resolve)
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and not isinstance(value, type):
        return to_plain(tolist(), fallback=fallback, resolve=resolve)
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, fallback=fallback, resolve=resolve) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v, fallback=fallback, resolve=resolve) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return to_plain(to_dict(), fallback=fallback, resolve=resolve)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return to_plain(fields, fallback=fallback, resolve=resolve)
    to_timestring = getattr(value, "to_timestring", None)
    if callable(to_timestring):
        return to_timestring()
    return fallback(value)


def describe_value(value: Any) -> Any:
    """``value`` as plain data for a run description: functions by qualified name, objects by type.

    Unlike ``repr``, the result has no memory addresses, so two runs' descriptions diff cleanly.
    """
    return to_plain(value, fallback=_describe_object)


def _describe_object(value: Any) -> str:
    if isinstance(value, functools.partial):
        return f"partial({_describe_object(value.func)})"
    if inspect.isroutine(value) or isinstance(value, type):
        module = getattr(value, "__module__", None) or ""
        name = str(getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__name__)
        return f"{module}.{name}" if module else name
    return type(value).__name__


def flatten(mapping: Mapping[str, Any], sep: str = ".", prefix: str = "") -> Dict[str, Any]:
    """Nested mappings as one level, keys joined by ``sep`` (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    out: Dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out
