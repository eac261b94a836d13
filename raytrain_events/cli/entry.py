"""Entry points for ``raytrain-events train``: ``module:function`` or ``path/to/file.py:function``.

An entry point is a function that takes its config as the first parameter, annotated with a
dataclass schema (``def train(cfg: MyConfig)``); the CLI builds that config from the schema's
defaults, ``--config`` and ``key=value`` overrides, and calls the function with it. A function
with no parameters takes no config. The default entry point is the digits job,
``examples/train.py:train_digits``, found in the current directory or in the source checkout the
package is imported from (an editable install); a wheel install ships no examples, so name one.

A function from a file is sent to Ray workers by value (the workers cannot import the file by
name); one from an importable module goes by reference, so that module must be importable on
every node (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import typing
from typing import Any, Callable, Optional

import raytrain_events
from raytrain_events.cli.errors import UsageError

__all__ = ["DEFAULT_ENTRY", "load_entry", "config_schema", "send_by_value", "is_entry_spec"]

DEFAULT_ENTRY = "examples/train.py:train_digits"


def is_entry_spec(text: str) -> bool:
    """Whether a command-line word names an entry point (``x:y``, no ``=``) rather than an override."""
    return ":" in text and "=" not in text and not text.startswith("-")


def load_entry(spec: Optional[str] = None) -> Callable[..., Any]:
    """The function ``spec`` names (default: `DEFAULT_ENTRY`); a `UsageError` says what is wrong and the fix."""
    spec = spec or DEFAULT_ENTRY
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(
            f"Entry point {spec!r} must be module:function or path/to/file.py:function "
            f"(for example {DEFAULT_ENTRY} or my_package.jobs:train)."
        )
    module = _load_file(spec, where) if where.endswith(".py") or os.sep in where else _import(spec, where)
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            available = sorted(
                n
                for n, v in vars(module).items()
                if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
            )
            raise UsageError(
                f"Entry point {spec!r}: {where} has no {name!r}. Its functions: {', '.join(available) or 'none'}."
            )
    if not callable(target):
        raise UsageError(f"Entry point {spec!r} is a {type(target).__name__}, not a function.")
    return target


def config_schema(fn: Callable[..., Any]) -> Optional[type]:
    """The dataclass annotating ``fn``'s first parameter (its config), or None when ``fn`` takes no parameter."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if not params:
        return None
    try:
        hint = typing.get_type_hints(fn).get(params[0].name)
    except Exception as exc:  # an annotation that does not resolve
        raise UsageError(f"Cannot read the annotations of {_name(fn)}: {exc}") from None
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        raise UsageError(
            f"{_name(fn)}({params[0].name}) needs a config schema: annotate its first parameter with a dataclass, "
            f"like `def {fn.__name__}(cfg: MyConfig)`, so the CLI knows the config keys and defaults."
        )
    return hint


def send_by_value(fn: Callable[..., Any]) -> None:
    """Let Ray pickle a file-loaded entry point's module by value (workers cannot import it by name)."""
    module = sys.modules.get(getattr(fn, "__module__", ""))
    if module is not None and getattr(module, "__raytrain_entry_file__", False):
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(module)


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(
                f"Entry point {spec!r}: no module named {module_name!r}. Install it or put it on PYTHONPATH, "
                "or name a file instead: path/to/file.py:function."
            ) from None
        raise


def _load_file(spec: str, path: str) -> Any:
    resolved = _find_file(path)
    if resolved is None:
        checkout = "" if os.path.isabs(path) else f" or {os.path.join(_checkout(), path)}"
        hint = (
            " The default entry point is the digits job in the source checkout's examples/ (a wheel install ships "
            "no examples): run from the repository root, or name an entry point."
            if spec == DEFAULT_ENTRY
            else ""
        )
        raise UsageError(f"Entry point {spec!r}: no file {os.path.abspath(path)}{checkout}.{hint}")
    name = "_raytrain_entry_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(resolved)[0])
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"Entry point {spec!r}: {resolved} is not a Python file Python can load (name it *.py).")
    module = importlib.util.module_from_spec(module_spec)
    setattr(module, "__raytrain_entry_file__", True)  # noqa: B010  (marks the modules this loader made)
    sys.modules[name] = module  # dataclasses and typing look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _find_file(path: str) -> Optional[str]:
    """``path`` as given (relative to the current directory), else relative to the source checkout."""
    candidates = [path] if os.path.isabs(path) else [path, os.path.join(_checkout(), path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def _checkout() -> str:
    """The folder holding the imported ``raytrain_events`` package (the repository root for a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(raytrain_events.__file__)))


def _name(fn: Callable[..., Any]) -> str:
    module = sys.modules.get(getattr(fn, "__module__", ""))
    where = module.__file__ if getattr(module, "__raytrain_entry_file__", False) else getattr(fn, "__module__", "?")
    return f"{where}:{getattr(fn, '__qualname__', fn)}"
