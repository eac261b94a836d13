"""Loading a script of ``examples/`` as a module, as the tests of the examples do (its functions are what
``python examples/<file>`` runs; the module is not put in ``sys.modules``, so Ray pickles its functions by value)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(filename: str, name: str) -> ModuleType:
    """``examples/<filename>`` executed as a fresh module called ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, filename))
    assert spec is not None and spec.loader is not None, filename
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
