"""Reading and replacing the inputs or targets of a batch without mutating the loader's objects.

Algorithms find inputs and targets the way `raytrain_events.models.ClassifierModel` does: an
``(inputs, targets)`` pair uses positions 0 and 1; a dict batch uses the model's ``input_key`` /
``target_key`` attributes (``"x"`` / ``"y"`` by default). Replacing an item returns a new tuple,
list or dict, so the batch the dataloader produced (and the full batch the trainer restores
after gradient accumulation) is never changed in place.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

__all__ = ["BatchKey", "resolve_key", "get_item", "set_item", "num_classes_of", "to_probabilities"]

BatchKey = Union[int, str, None]


def resolve_key(batch: Any, key: BatchKey, role: str, model: Any) -> Union[int, str]:
    """The concrete key for ``role`` ("input" or "target") in ``batch``; ``key=None`` means the default."""
    if key is not None:
        return key
    if isinstance(batch, Mapping):
        return getattr(model, f"{role}_key", "x" if role == "input" else "y")
    if isinstance(batch, (list, tuple)):
        return 0 if role == "input" else 1
    raise TypeError(
        f"Cannot find the {role}s in a batch of type {type(batch).__name__}: algorithms expect an "
        "(inputs, targets) pair or a dict batch; pass input_key=/target_key= to the algorithm."
    )


def get_item(batch: Any, key: Union[int, str]) -> Any:
    """``batch[key]`` with an error that names the batch's keys."""
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError) as exc:
        have = sorted(batch) if isinstance(batch, Mapping) else f"{len(batch)} items"
        raise KeyError(
            f"The batch has no item {key!r} (it has {have}); pass input_key=/target_key= to the algorithm."
        ) from exc


def set_item(batch: Any, key: Union[int, str], value: Any) -> Any:
    """A copy of ``batch`` with ``batch[key] = value`` (same container type)."""
    if isinstance(batch, Mapping):
        new = dict(batch)
        new[key] = value
        return new
    if isinstance(batch, (list, tuple)):
        items = list(batch)
        items[key] = value  # type: ignore[index]
        return type(batch)(items) if not _is_namedtuple(batch) else type(batch)(*items)
    raise TypeError(f"Cannot replace item {key!r} in a batch of type {type(batch).__name__}.")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def num_classes_of(outputs: Any, where: str) -> int:
    """Number of classes from model outputs ``(N, C, ...)``; a clear error otherwise."""
    shape: Optional[tuple] = getattr(outputs, "shape", None)
    if shape is None or len(shape) < 2:
        raise TypeError(
            f"{where} needs state.outputs to be logits of shape (N, C, ...) to know the number of classes, "
            f"got {type(outputs).__name__} with shape {shape}."
        )
    return int(shape[1])


def to_probabilities(targets: Any, num_classes: int, dtype: Any) -> Any:
    """Integer class targets ``(N, ...)`` as one-hot probabilities ``(N, C, ...)``; soft targets unchanged."""
    import torch.nn.functional as F

    if targets.is_floating_point():
        return targets.to(dtype)
    one_hot = F.one_hot(targets.long(), num_classes).to(dtype)
    return one_hot.movedim(-1, 1) if one_hot.dim() > 2 else one_hot
