"""An Arrow table (a batch of the train order) as a dict of torch tensors, without per-row objects.

Ray Data's ``to_batch_format("numpy")`` turns a list or binary column (pre-tokenized text: a
fixed-size list of int32/uint16 tokens, or their bytes) into an object array of one NumPy array per
row, which then has to be stacked again. Here each column becomes one tensor straight from its Arrow
buffers (`column_tensor`):

* numbers and booleans: a tensor of the column (zero-copy without nulls; booleans are unpacked);
* a fixed-size list, or a list whose rows all have one length, of numbers: ``(rows, length)``
  over the flat values (zero-copy);
* binary (or fixed-size binary) whose rows all have one length: ``(rows, bytes)`` of uint8 over the
  data buffer (zero-copy), viewed as the field's ``dtype`` when its Arrow metadata names one
  (``pa.field("tokens", pa.binary(), metadata={"dtype": "int32"})``): ``(rows, tokens)``;
* anything else (strings, ragged lists, nulls) goes through Ray Data's own conversion, as before.

Zero-copy tensors share memory with the block, which may be read-only shared memory (Ray's object
store): they are for reading, as Ray Data's own batches are; copy one before changing it in place.
A batch that spans two blocks is one table of two chunks; its columns are concatenated once, here.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import numpy as np
import pyarrow as pa

from raytrain_events.ray._compat import ndarray_batch_to_torch

__all__ = ["table_to_torch", "column_tensor"]


def table_to_torch(table: Any) -> Dict[str, Any]:
    """``{column: tensor}`` of a pyarrow Table (see module doc)."""
    out: Dict[str, Any] = {}
    other = []
    for field, column in zip(table.schema, table.columns):
        tensor = column_tensor(column, field)
        if tensor is None:
            other.append(field.name)
        else:
            out[field.name] = tensor
    if not other:
        return out  # in the table's order
    from ray.data.block import BlockAccessor

    out.update(ndarray_batch_to_torch(BlockAccessor.for_block(table.select(other)).to_batch_format("numpy")))
    return {name: out[name] for name in table.column_names}


def column_tensor(column: Any, field: Any = None) -> Optional[Any]:
    """One column (a pyarrow Array or ChunkedArray) as a tensor, or None where it needs Ray's conversion."""
    array = column
    if isinstance(column, pa.ChunkedArray):
        array = column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)
    if array.null_count:
        return None
    values = _numpy(array, field)
    if values is None:
        return None
    return from_numpy(values)


def from_numpy(values: np.ndarray) -> Any:
    """``torch.from_numpy``, quiet on a read-only view of a block (as Ray Data's own batches are).

    torch warns once per process about a read-only array; the first read-only conversions run under
    ``warnings.catch_warnings`` (which copies the filter list: a few microseconds) until one of them
    warned nothing, and then none does (`_QUIET`). If a torch version warned on every call, every
    call would keep the guard."""
    global _QUIET  # noqa: PLW0603 (a once-per-process probe)
    import torch

    if _QUIET or values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        tensor = torch.from_numpy(values)
    if not caught:  # torch's warning is spent: plain calls from now on
        _QUIET = True
    return tensor


_QUIET = False


def _numpy(array: Any, field: Any) -> Optional[np.ndarray]:
    kind = array.type
    n = len(array)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return array.to_numpy(zero_copy_only=True)
    if pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _list_numpy(array, kind, n)
    if pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        out = data[array.offset * width : (array.offset + n) * width].reshape(n, width)
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        offsets = _offsets(array)
        width = _equal_width(offsets, n)
        if width is None:
            return None
        buffer = array.buffers()[2]
        data = np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.empty(0, np.uint8)
        out = data[offsets[0] : offsets[0] + n * width].reshape(n, width)
    else:
        return None
    dtype = (field.metadata or {}).get(b"dtype") if field is not None else None
    if dtype is not None:
        out = out.view(np.dtype(dtype.decode()))
    return out


def _list_numpy(array: Any, kind: Any, n: int) -> Optional[np.ndarray]:
    """A list column of numbers whose rows have one length as ``(rows, length)``, over the child's values."""
    inner = kind.value_type
    if not (pa.types.is_integer(inner) or pa.types.is_floating(inner)):
        return None
    if pa.types.is_fixed_size_list(kind):
        width = kind.list_size
        lo = array.offset * width
    else:
        offsets = _offsets(array)
        width = _equal_width(offsets, n)
        if width is None:
            return None
        lo = int(offsets[0])
    child = array.values  # the whole child array (not cut to the slice: cheaper than flatten())
    if child.null_count:  # somewhere in the child: the slice's own values decide
        flat = array.flatten()
        if flat.null_count:
            return None
        return flat.to_numpy(zero_copy_only=True).reshape(n, width)
    return child.to_numpy(zero_copy_only=True)[lo : lo + n * width].reshape(n, width)


def _offsets(array: Any) -> np.ndarray:
    """The ``len + 1`` offsets of a (large) list or binary array, its slice offset applied."""
    large = pa.types.is_large_list(array.type) or pa.types.is_large_binary(array.type)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if large else np.int32)
    return offsets[array.offset : array.offset + len(array) + 1]


def _equal_width(offsets: np.ndarray, n: int) -> Optional[int]:
    """The one row length of a list/binary array with these offsets, or None if rows differ."""
    if n == 0:
        return 0
    width = int(offsets[1] - offsets[0])
    if int(offsets[n] - offsets[0]) != width * n or not np.all(np.diff(offsets[: n + 1]) == width):
        return None
    return width
