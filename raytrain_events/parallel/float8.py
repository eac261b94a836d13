"""Float8 training through torchao: which GPUs and packages support it, and the conversion.

Why: on GPUs with float8 tensor cores (NVIDIA compute capability 8.9+: H100, H200, L4, RTX 4090)
torchao's ``Float8Linear`` runs the matmuls of ``nn.Linear`` layers in float8 with dynamic
per-tensor scales, about 1.3-1.5x faster for large transformer layers, while the weights stay in
their own dtype (the optimizer is unchanged). Elsewhere it cannot run (or only emulated, which is
for tests: slower than plain fp32), so it is refused with the reason.

The conversion swaps eligible ``nn.Linear`` modules in place; it must run before FSDP shards the
model (the loop does it at ``INIT``, see `raytrain_events.algorithms.float8`). Eligible: both
dimensions divisible by 16 (float8 GEMM tiles), and not excluded by name (the output head by
default, whose precision matters most).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["Float8Unsupported", "check_float8_support", "convert_to_float8", "float8_eligible"]

MIN_CAPABILITY = (8, 9)


class Float8Unsupported(RuntimeError):
    """Float8 training cannot run here (package, device or model); the message says why and the fix."""


def check_float8_support(device: torch.device, emulate: bool = False) -> None:
    """Raise `Float8Unsupported` unless torchao is importable and ``device`` has float8 matmuls
    (``emulate=True`` skips the device check: numerics emulated in higher precision, tests only)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise Float8Unsupported(
            f"Float8 training needs torchao ({e}). Fix: pip install 'raytrain_events[float8]' (torchao>=0.10)."
        ) from None
    if emulate:
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Float8Unsupported(
            f"Float8 training needs an NVIDIA GPU with float8 tensor cores (compute capability >= 8.9: H100, H200, "
            f"L4, RTX 4090); this run's device is {device.type!r}. Fix: drop the Float8Training algorithm here, "
            "or run on such a GPU."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise Float8Unsupported(
            f"Float8 training needs compute capability >= 8.9 (H100, H200, L4, RTX 4090); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Fix: use precision='amp_bf16'."
        )


def float8_eligible(module: torch.nn.Module, fqn: str, skip: Sequence[str] = ()) -> bool:
    """True for an ``nn.Linear`` whose dimensions are multiples of 16 and whose name is not skipped."""
    if type(module) is not torch.nn.Linear:
        return False
    if any(fqn == s or fqn.endswith("." + s) or fqn.split(".")[-1] == s for s in skip):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(
    model: torch.nn.Module,
    *,
    skip: Sequence[str] = ("lm_head", "head", "output"),
    fsdp_float8_all_gather: bool = False,
    emulate: bool = False,
) -> int:
    """Swap the eligible Linear layers of ``model`` for torchao ``Float8Linear`` in place; returns how many.

    ``fsdp_float8_all_gather``: FSDP gathers the weights in float8 (half the all-gather bytes of
    bf16); then call ``torchao.float8.precompute_float8_dynamic_scale_for_fsdp`` after each step
    (`Float8Training` does).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    eligible = [fqn for fqn, m in model.named_modules() if float8_eligible(m, fqn, skip)]
    if not eligible:
        raise Float8Unsupported(
            f"{type(model).__name__} has no nn.Linear with both dimensions divisible by 16 outside {list(skip)}; "
            "float8 would change nothing. Fix: drop Float8Training for this model."
        )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: float8_eligible(m, fqn, skip), config=config)
    return len(eligible)


def model_device(model: torch.nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter that holds data (None: none, or all on meta)."""
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return None
