"""``torch.compile`` for the train model: ``Trainer(compile=True)`` or a dict of `torch.compile` options.

The model is compiled in place with ``nn.Module.compile`` right after the INIT event: algorithms
that change the model at INIT (ChannelsLast converts its memory format, StochasticDepth replaces
blocks) have run, and DDP (or FSDP) wraps the module afterwards, so DDP calls the compiled forward.
In-place compilation keeps ``state.model`` the user's module, with the same parameter names in
checkpoints (no ``_orig_mod.`` prefix). Only ``forward`` is compiled; ``loss`` and
``eval_forward`` run eagerly. Compilation itself happens on the first forward.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Mapping, Optional, Union

import torch

__all__ = ["compile_options", "compile_model"]


def compile_options(value: Union[bool, Mapping[str, Any], None]) -> Optional[Dict[str, Any]]:
    """The `torch.compile` keyword arguments for ``compile=value`` (None: do not compile); bad input raises."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        known = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"compile={dict(value)!r}: unknown torch.compile options {unknown}; known: {sorted(known)}."
            )
        return dict(value)
    raise TypeError(
        f"compile={value!r}: pass True, False, or a dict of torch.compile options like {{'mode': 'max-autotune'}}."
    )


def compile_model(model: torch.nn.Module, options: Dict[str, Any]) -> None:
    """Compile ``model``'s forward in place (``model(...)`` then runs the compiled code)."""
    model.compile(**options)


def is_compiled(model: torch.nn.Module) -> bool:
    """True if ``model`` was compiled in place (`compile_model`)."""
    return getattr(model, "_compiled_call_impl", None) is not None
