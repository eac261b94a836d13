"""`DataSpec`: how the loop counts samples and tokens in a batch and splits it into microbatches.

Defaults: samples are the leading dimension of the first tensor; tokens are 0 unless you say
how to count them (pass ``get_num_tokens_in_batch``); batches split along dim 0. Batches may
be a tensor, a tuple/list of tensors, or a dict of tensors (Ray Data yields dicts). A packed batch
in the ``cu_seqlens`` format (``PackedTokens(document_format="cu_seqlens")``: ``cu_seqlens`` over
all its rows, ``max_seqlen``) splits by rows too, each part with its own rows' ``cu_seqlens``
(from 0) and ``max_seqlen`` (`cut_rows`).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

from raytrain_events.core.segments import is_segmented, segment_rows

__all__ = [
    "DataSpec",
    "check_loader",
    "cut_rows",
    "default_num_samples",
    "default_split_batch",
    "ensure_data_spec",
]


def _first_tensor(batch: Any) -> Any:
    if hasattr(batch, "shape"):
        return batch
    if isinstance(batch, Mapping):
        for value in batch.values():
            if hasattr(value, "shape"):
                return value
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            if hasattr(value, "shape"):
                return value
    raise TypeError(
        f"Cannot count samples in a batch of type {type(batch).__name__}: expected a tensor, a "
        "tuple/list or a dict of tensors. Pass DataSpec(get_num_samples_in_batch=...) to count it yourself."
    )


def default_num_samples(batch: Any) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor."""
    n: int
    kind = type(batch)
    if kind is dict:  # Ray Data's batches, every step: no isinstance against typing.Mapping (~3 µs)
        for value in batch.values():
            if hasattr(value, "shape"):
                n = value.shape[0]
                return n
    elif (kind is tuple or kind is list) and batch and hasattr(batch[0], "shape"):
        n = batch[0].shape[0]
        return n
    return int(_first_tensor(batch).shape[0])


def default_split_batch(batch: Any, num_microbatches: int) -> List[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``num_microbatches`` nearly equal parts."""
    if num_microbatches == 1:
        return [batch]
    if hasattr(batch, "tensor_split"):
        return list(batch.tensor_split(num_microbatches))
    if isinstance(batch, Mapping) and "cu_seqlens" in batch and "input_ids" in batch:
        return _split_cu_seqlens(batch, num_microbatches)
    if isinstance(batch, Mapping):
        parts = {k: _split_or_repeat(v, num_microbatches) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(num_microbatches)]
    if isinstance(batch, (list, tuple)):
        columns = [_split_or_repeat(v, num_microbatches) for v in batch]
        return [type(batch)(p[i] for p in columns) for i in range(num_microbatches)]
    raise TypeError(
        f"Cannot split a batch of type {type(batch).__name__} into microbatches: pass "
        "DataSpec(split_batch=fn) where fn(batch, n) returns a list of n microbatches."
    )


def _split_cu_seqlens(batch: Mapping[str, Any], n: int) -> List[Any]:
    """A ``cu_seqlens`` batch in ``n`` parts of rows (as ``tensor_split`` cuts ``input_ids``), each `cut_rows`'
    part, with every part's boundaries found in one ``searchsorted`` (one host read per batch, not per part)."""
    import torch

    tokens, cu = batch["input_ids"], batch["cu_seqlens"]
    bounds = [0]
    for part in tokens.tensor_split(n):
        bounds.append(bounds[-1] + len(part))
    ends = torch.tensor(bounds, dtype=cu.dtype, device=cu.device) * tokens.shape[1]
    at = torch.searchsorted(cu, ends).tolist()  # each row boundary's index in cu_seqlens
    return [_cu_seqlens_rows(batch, bounds[i], bounds[i + 1], at[i], at[i + 1]) for i in range(n)]


def cut_rows(batch: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of a batch (a tensor, a dict or a tuple of them), in any packed form too: a segmented
    batch (`core.segments.is_segmented`) gets its rows' segments (`core.segments.segment_rows`), a
    ``cu_seqlens`` one its rows' pieces from 0 and their ``max_seqlen`` (no piece crosses a row: each row's
    end is a boundary). The one row cut of a batch (replica groups' parts, microbatches of ``cu_seqlens``)."""
    if is_segmented(batch):
        return segment_rows(batch, lo, hi)
    if isinstance(batch, Mapping) and "cu_seqlens" in batch and "input_ids" in batch:
        import torch

        cu, seq_len = batch["cu_seqlens"], batch["input_ids"].shape[1]
        ends = torch.tensor([lo * seq_len, hi * seq_len], dtype=cu.dtype, device=cu.device)
        a, b = torch.searchsorted(cu, ends).tolist()  # the two row boundaries' indices in cu_seqlens
        return _cu_seqlens_rows(batch, lo, hi, a, b)
    if isinstance(batch, Mapping):
        return {k: v[lo:hi] for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(v[lo:hi] for v in batch)
    return batch[lo:hi]


def _cu_seqlens_rows(batch: Mapping[str, Any], lo: int, hi: int, a: int, b: int) -> Dict[str, Any]:
    """Rows ``lo:hi`` of a ``cu_seqlens`` batch whose row boundaries are ``cu_seqlens[a]`` and ``cu_seqlens[b]``."""
    cu = batch["cu_seqlens"]
    part = {k: v[lo:hi] if hasattr(v, "dim") and v.dim() and k != "cu_seqlens" else v for k, v in batch.items()}
    part["cu_seqlens"] = cu[a : b + 1] - cu[a]
    lengths = part["cu_seqlens"].diff()
    part["max_seqlen"] = lengths.max().to(batch["max_seqlen"].dtype) if len(lengths) else batch["max_seqlen"] * 0
    return part


def _split_or_repeat(value: Any, n: int) -> List[Any]:
    return list(value.tensor_split(n)) if hasattr(value, "tensor_split") else [value] * n


class DataSpec:
    """A dataloader plus the functions that describe its batches.

    ``device_transforms``: a function of each batch after the loop moved it to the device, before any
    event sees it (`Event.AFTER_DATALOADER`) and before it is counted. A dataloader with a
    ``device_transforms`` method of its own (the Ray train loader, `GlobalOrderLoader`: a packed batch's
    ``document_ids``/``position_ids`` made on the device from O(runs) numbers) has it run first, then yours.

    Example::

        DataSpec(loader, get_num_tokens_in_batch=lambda b: int(b["attention_mask"].sum()))
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        *,
        num_samples: Optional[int] = None,
        num_tokens: Optional[int] = None,
        get_num_samples_in_batch: Optional[Callable[[Any], int]] = None,
        get_num_tokens_in_batch: Optional[Callable[[Any], int]] = None,
        split_batch: Optional[Callable[[Any, int], List[Any]]] = None,
        device_transforms: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.dataloader = dataloader
        self.num_samples = num_samples
        self.num_tokens = num_tokens
        self.get_num_samples_in_batch = get_num_samples_in_batch or default_num_samples
        self.get_num_tokens_in_batch = get_num_tokens_in_batch
        self.counts_tokens = get_num_tokens_in_batch is not None
        self.split_batch = split_batch or default_split_batch
        # A loader that finishes its batches on the device (its ``device_transforms``: `GlobalOrderLoader`'s makes a
        # packed batch's per-token columns there) goes first; the user's own then get the batch the model would.
        self.device_transforms = _then(getattr(dataloader, "device_transforms", None), device_transforms)

    def num_tokens_in_batch(self, batch: Any) -> int:
        """Tokens in ``batch`` (0 unless a token counter was given); a count that is not a whole
        number (None, 2.5, a float tensor) is refused, not rounded."""
        fn = self.get_num_tokens_in_batch
        if fn is None:
            return 0
        tokens = fn(batch)
        if type(tokens) is int:  # the common case, checked first (per batch)
            return tokens
        return _whole_count(tokens, fn)


def _then(
    first: Optional[Callable[[Any], Any]], second: Optional[Callable[[Any], Any]]
) -> Optional[Callable[[Any], Any]]:
    """``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda batch: second(first(batch))


def _whole_count(value: Any, fn: Any) -> int:
    """``value`` as an int if it is an integer (int, numpy integer, integer 0-d tensor); else a TypeError."""
    is_integer_tensor = hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0 and not value.dtype.is_floating_point
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if is_integer_tensor and str(value.dtype) != "torch.bool":
        return int(value)
    raise TypeError(
        f"get_num_tokens_in_batch ({getattr(fn, '__name__', fn)!r}) returned {value!r} "
        f"({type(value).__name__}); it must return the batch's token count as an int. Fix: return "
        "int(...) of a count, e.g. lambda b: int(b['attention_mask'].sum())."
    )


def check_loader(dataloader: Any, what: str) -> None:
    """Refuse what the loop cannot iterate as batches, naming the fix.

    A map-style dataset (``__getitem__`` and ``__len__``, e.g. a ``TensorDataset``) iterates rows,
    not batches: each row would be taken as a batch and counted wrongly, so it is refused (wrap
    it in a ``DataLoader``). An ``IterableDataset`` that yields batches is accepted.
    """
    name = type(dataloader).__name__
    is_map_dataset = any(
        cls.__name__ == "Dataset" and cls.__module__.startswith("torch.utils.data") for cls in type(dataloader).__mro__
    ) and not any(cls.__name__ == "IterableDataset" for cls in type(dataloader).__mro__)
    if is_map_dataset:
        raise TypeError(
            f"{what} is a {name}, a dataset of rows, not of batches (each row would be taken as a batch). "
            f"Fix: wrap it in a DataLoader: {what}=torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)."
        )
    inner = getattr(dataloader, "dataset", None)
    if getattr(inner, "yields_batches", False) or type(inner).__name__ == "DataLoader":
        kind = type(inner).__name__
        raise TypeError(
            f"{what} is a {name} around a {kind}, which already yields batches (the {name} would batch its batches). "
            f"Fix: pass the {kind} itself, {what}={kind[0].lower() + kind[1:]}, with its own batch_size."
        )
    if isinstance(dataloader, (str, bytes)) or not hasattr(dataloader, "__iter__"):
        raise TypeError(
            f"{what}={dataloader!r} ({name}) is not a dataloader: pass an iterable of batches, like "
            "torch.utils.data.DataLoader(dataset, batch_size=64) (or a DataSpec wrapping one)."
        )


def ensure_data_spec(dataloader: Any, what: str = "dataloader") -> DataSpec:
    """Wrap a plain dataloader in a default `DataSpec`; pass a `DataSpec` through (both checked)."""
    spec = dataloader if isinstance(dataloader, DataSpec) else DataSpec(dataloader)
    check_loader(spec.dataloader, what)
    return spec
