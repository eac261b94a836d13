"""Build algorithms by name, so configs can say ``"label_smoothing"`` instead of importing a class.

Example::

    from raytrain_events.algorithms import build_algorithms, register_algorithm

    algorithms = build_algorithms(["channels_last", {"name": "label_smoothing", "smoothing": 0.1}])

    @register_algorithm("my_algo")
    class MyAlgo(Algorithm):
        ...

A spec is a registered name, a ``{"name": ..., **kwargs}`` dict, or an `Algorithm` instance
(passed through). Unknown names and bad arguments fail with the list of what is accepted.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Union

from raytrain_events.core.algorithm import Algorithm

__all__ = ["register_algorithm", "build_algorithm", "build_algorithms", "available_algorithms"]

_REGISTRY: Dict[str, Callable[..., Algorithm]] = {}

AlgorithmSpec = Union[str, Mapping[str, Any], Algorithm]


def _normalize(name: str) -> str:
    """``"LabelSmoothing"``, ``"label-smoothing"`` and ``"label_smoothing"`` all become ``"label_smoothing"``."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name.strip())
    return snake.replace("-", "_").lower()


def register_algorithm(name: str, *, overwrite: bool = False) -> Callable:
    """Class decorator: make ``build_algorithm(name)`` construct this class."""
    key = _normalize(name)

    def _register(factory: Callable[..., Algorithm]) -> Callable[..., Algorithm]:
        if not callable(factory):
            raise TypeError(f"register_algorithm({name!r}) must decorate an Algorithm class, got {factory!r}.")
        if isinstance(factory, type) and not issubclass(factory, Algorithm):
            raise TypeError(f"{factory.__name__} is not an Algorithm subclass; subclass raytrain_events.Algorithm.")
        if key in _REGISTRY and _REGISTRY[key] is not factory and not overwrite:
            raise ValueError(
                f"An algorithm named {key!r} is already registered ({_REGISTRY[key]!r}); "
                "choose another name or pass overwrite=True."
            )
        _REGISTRY[key] = factory
        return factory

    return _register


def available_algorithms() -> List[str]:
    """Sorted names that `build_algorithm` accepts."""
    return sorted(_REGISTRY)


def _describe_parameters(factory: Callable) -> str:
    parts = []
    for param in inspect.signature(factory).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        parts.append(param.name if param.default is param.empty else f"{param.name}={param.default!r}")
    return ", ".join(parts) or "(no arguments)"


def build_algorithm(spec: AlgorithmSpec) -> Algorithm:
    """One `Algorithm` from a name, a ``{"name": ..., **kwargs}`` dict, or an instance."""
    if isinstance(spec, Algorithm):
        return spec
    if isinstance(spec, str):
        name, kwargs = spec, {}
    elif isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"Algorithm spec {dict(spec)!r} has no 'name': use {{'name': 'label_smoothing', ...}}.")
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
        if not isinstance(name, str):
            raise TypeError(f"Algorithm spec 'name' must be a string, got {name!r}.")
    else:
        raise TypeError(
            f"Cannot build an algorithm from {type(spec).__name__} {spec!r}: give a name like 'label_smoothing', "
            "a dict {'name': ..., **kwargs}, or an Algorithm instance."
        )
    key = _normalize(name)
    factory = _REGISTRY.get(key)
    if factory is None:  # "MixUp" -> "mix_up" should still find "mixup"
        squashed = {k.replace("_", ""): k for k in _REGISTRY}
        key = squashed.get(key.replace("_", ""), key)
        factory = _REGISTRY.get(key)
    if factory is None:
        close = difflib.get_close_matches(key, available_algorithms(), n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"Unknown algorithm {name!r}. {hint}Known algorithms: {', '.join(available_algorithms())}.")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise TypeError(
            f"Bad arguments for algorithm {key!r} ({exc}); it accepts: {_describe_parameters(factory)}."
        ) from None
    algorithm = factory(**kwargs)
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"The factory registered as {key!r} returned {algorithm!r}, not an Algorithm.")
    return algorithm


def build_algorithms(specs: Iterable[AlgorithmSpec]) -> List[Algorithm]:
    """`build_algorithm` for each spec, keeping the order (which is the Engine's order)."""
    listed: Iterable[AlgorithmSpec] = [specs] if isinstance(specs, (str, Mapping, Algorithm)) else specs
    return [build_algorithm(spec) for spec in listed]
