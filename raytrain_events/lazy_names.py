"""A package's public names, each loaded from its module on first use (a PEP 562 ``__getattr__``).

A Ray actor of ours that imports one light module (the data feeder, the run history, Ray Data's
dataset manager unpickling our `DataConfig`) runs its packages' ``__init__`` first; eager
re-exports there would import torch into processes that never run a tensor, at every start.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def lazy_names(package: str, names: Dict[str, str], namespace: Dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``names`` maps each public name to the module defining it
    (a name that is itself a submodule, ``"tune": "raytrain_events.tune"``, is that module). A value
    is kept in ``namespace`` (the package's globals), so later lookups do not come here."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        value = loaded if module == f"{package}.{name}" else getattr(loaded, name)
        namespace[name] = value
        return value

    return __getattr__
