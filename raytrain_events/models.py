"""Adapters that give a plain ``nn.Module`` the model protocol the loop expects.

`ClassifierModel` wraps a classifier: ``forward`` takes the batch, ``loss`` is cross-entropy,
and accuracy is computed with torchmetrics on eval (and on train when asked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict

import torch
import torch.nn.functional as F

__all__ = ["ClassifierModel", "split_inputs_targets"]


_PAIR_TYPES = (tuple, list)


def split_inputs_targets(batch: Any, input_key: str = "x", target_key: str = "y"):
    """``(inputs, targets)`` from a pair or from a dict with ``input_key``/``target_key``."""
    if type(batch) in _PAIR_TYPES and len(batch) == 2:  # the common case first: cheapest check
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        try:
            return batch[input_key], batch[target_key]
        except KeyError as exc:
            raise KeyError(
                f"Batch has columns {sorted(batch)}, but the model needs {input_key!r} and {target_key!r}: "
                "rename the columns or pass input_key=/target_key= to the model."
            ) from exc
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"Expected an (inputs, targets) pair or a dict batch, got {type(batch).__name__}.")


class ClassifierModel(torch.nn.Module):
    """A classifier in the model protocol.

    Example::

        model = ClassifierModel(torch.nn.Linear(64, 10), num_classes=10)
    """

    def __init__(
        self, module: torch.nn.Module, *, num_classes: int, input_key: str = "x", target_key: str = "y"
    ) -> None:
        super().__init__()
        self.module = module
        self.num_classes = num_classes
        self.input_key, self.target_key = input_key, target_key

    # forward and loss run once per step: an (inputs, targets) pair or a dict (Ray Data's batches)
    # is unpacked inline (no call, no isinstance against an ABC), and the module is reached
    # through ``_modules`` (skips ``Module.__getattr__``).
    def forward(self, batch: Any) -> torch.Tensor:
        if type(batch) in _PAIR_TYPES and len(batch) == 2:
            inputs = batch[0]
        elif type(batch) is dict and self.input_key in batch:
            inputs = batch[self.input_key]
        else:
            inputs, _ = split_inputs_targets(batch, self.input_key, self.target_key)
        return self._modules["module"](inputs)  # type: ignore[misc, no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        if type(batch) in _PAIR_TYPES and len(batch) == 2:
            targets = batch[1]
        elif type(batch) is dict and self.target_key in batch:
            targets = batch[self.target_key]
        else:
            _, targets = split_inputs_targets(batch, self.input_key, self.target_key)
        # Soft targets (from MixUp/CutMix/label smoothing) are class probabilities.
        return F.cross_entropy(outputs, targets)

    def eval_forward(self, batch: Any, outputs: Any = None) -> torch.Tensor:
        # Through __call__, not self.forward: FSDP gathers the sharded parameters in its forward hooks.
        return outputs if outputs is not None else self(batch)

    def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
        # Imported here, not at the top: importing torchmetrics imports its audio and text metrics
        # (scipy.signal, transformers), 3-5 s of CPU that a process which never evaluates should not pay.
        from torchmetrics.classification import MulticlassAccuracy

        from raytrain_events.metrics import CrossEntropy  # why here: metrics.py imports torchmetrics (above)

        return {
            "accuracy": MulticlassAccuracy(num_classes=self.num_classes, average="micro"),
            "cross_entropy": CrossEntropy(),
        }

    def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Any) -> None:
        _, targets = split_inputs_targets(batch, self.input_key, self.target_key)
        if targets.dim() > 1:  # soft targets: compare against the argmax class
            targets = targets.argmax(dim=-1)
        metric.update(outputs, targets)
