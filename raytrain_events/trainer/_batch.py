"""Small helpers the loop uses per batch: device moves, loss reduction, model checks."""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping

import torch

__all__ = ["move_to_device", "device_batches", "total_loss", "check_model"]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` to ``device`` (a no-op on CPU)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def device_batches(spec: Any, device: torch.device, limit: int = -1) -> Iterator[Any]:
    """The batches of a `DataSpec`'s dataloader on ``device``, its device transforms applied; at most
    ``limit`` batches (-1: all). Evaluation and prediction read their data this way."""
    for index, batch in enumerate(spec.dataloader):
        if limit != -1 and index >= limit:
            break
        batch = move_to_device(batch, device)
        yield spec.device_transforms(batch) if spec.device_transforms is not None else batch


def total_loss(loss: Any) -> torch.Tensor:
    """A single tensor from what ``model.loss`` returned (a tensor, or a dict/tuple summed)."""
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(loss, Mapping):
        if "total" in loss:
            total: torch.Tensor = loss["total"]
            return total
        return _sum(list(loss.values()))
    if isinstance(loss, (list, tuple)):
        return _sum(list(loss))
    raise TypeError(f"model.loss returned {type(loss).__name__}; return a tensor, or a dict/tuple of tensors.")


def _sum(losses: List[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors (as ``sum`` adds them, left to right)."""
    total = losses[0]
    for one in losses[1:]:
        total = total + one
    return total


def check_model(model: Any) -> None:
    """Fail early, naming the fix, if ``model`` does not follow the model protocol."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(getattr(model, "loss", None)):
        raise TypeError(
            f"{type(model).__name__} has no loss(outputs, batch) method. Add one, or wrap a plain module: "
            "raytrain_events.models.ClassifierModel(module) for classification."
        )
