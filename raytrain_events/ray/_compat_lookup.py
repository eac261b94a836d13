"""How `_compat` reaches a private Ray name (part of `_compat`'s table): each lookup raises `RayCompatError`
naming the Ray version and the missing name, instead of failing somewhere deep in a run."""

from __future__ import annotations

import importlib
from typing import Any, Optional

__all__ = ["RayCompatError"]


class RayCompatError(RuntimeError):
    """A private Ray name this package relies on is gone (a Ray upgrade changed it)."""


def _ray_version() -> str:
    try:
        import ray

        return ray.__version__
    except Exception:  # pragma: no cover - Ray not importable at all
        return "unknown"


def _missing(name: str, exc: Optional[BaseException] = None) -> RayCompatError:
    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return RayCompatError(
        f"Ray {_ray_version()} has no {name}{detail}. raytrain_events relies on it (see "
        "raytrain_events/ray/_compat.py, checked against Ray 2.60.0): install a Ray version it supports, "
        "or update raytrain_events.ray._compat for this one."
    )


def _import(module: str, attr: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise _missing(f"{module}.{attr}", exc) from exc


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError as exc:
        raise _missing(f"{type(obj).__module__}.{type(obj).__qualname__}.{name}", exc) from exc
