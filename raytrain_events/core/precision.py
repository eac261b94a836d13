"""Numerical precision: resolve "fp32" / "amp_bf16" / "amp_fp16" into an autocast context."""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Any, ContextManager, Union

__all__ = ["Precision", "autocast_context"]


class Precision(str, Enum):
    """Training precision: full fp32, or autocast mixed precision in bf16 or fp16."""

    FP32 = "fp32"
    AMP_BF16 = "amp_bf16"
    AMP_FP16 = "amp_fp16"

    @classmethod
    def parse(cls, value: Union[str, Precision]) -> Precision:
        """Accept a `Precision` or its string; name the valid choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"Unknown precision {value!r}: use one of {valid}.") from None


# One shared no-op context (nullcontext is reusable and reentrant): fp32 steps allocate nothing here.
_NULL_CONTEXT = contextlib.nullcontext()


def autocast_context(precision: Precision, device_type: str) -> ContextManager[Any]:
    """The context manager that runs forward and loss in ``precision`` on ``device_type``."""
    if precision is Precision.FP32:
        return _NULL_CONTEXT
    import torch

    dtype = torch.bfloat16 if precision is Precision.AMP_BF16 else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)
