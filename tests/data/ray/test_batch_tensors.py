"""`batch_tensors.table_to_torch` without Ray: each column kind against a per-row reference, on sliced
and chunked tables (a rank's part of a batch is a slice of a block), with nulls in and out of the slice."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from raytrain_events.data.ray.batch_tensors import column_tensor, table_to_torch


def _rows(n: int, width: int) -> np.ndarray:
    return (np.arange(n)[:, None] * 100 + np.arange(width)).astype(np.int32)


def _table() -> pa.Table:
    n, width = 40, 6
    tokens = _rows(n, width)
    return pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "flag": pa.array(np.arange(n) % 3 == 0),
            "fixed": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), width),
            "list": pa.array(list(tokens), pa.list_(pa.int32())),
            "large": pa.array(list(tokens.astype(np.int64)), pa.large_list(pa.int64())),
            "u16": pa.array([row.astype(np.uint16).tobytes() for row in tokens], pa.binary()),
        }
    ).replace_schema_metadata(None)


@pytest.mark.parametrize("cut", [(0, 40), (7, 13), (39, 1), (12, 0)])
def test_each_column_of_a_slice_equals_its_rows(cut) -> None:
    table = _table().slice(*cut)
    batch = table_to_torch(table)
    assert list(batch) == table.column_names
    assert torch.equal(batch["id"], torch.tensor(table.column("id").to_pylist(), dtype=torch.int64))
    assert torch.equal(batch["flag"], torch.tensor(table.column("flag").to_pylist(), dtype=torch.bool))
    for name, dtype in (("fixed", torch.int32), ("list", torch.int32), ("large", torch.int64)):
        rows = table.column(name).to_pylist()
        width = 6 if cut[1] or name == "fixed" else 0  # no rows: a list column's width is 0 (as before)
        assert batch[name].dtype == dtype and batch[name].shape == (cut[1], width)
        assert torch.equal(batch[name], torch.tensor(rows, dtype=dtype).reshape(cut[1], width))
    assert batch["u16"].shape == (cut[1], 12 if cut[1] else 0)  # binary without a dtype: bytes


def test_chunked_columns_are_joined_and_ragged_ones_left_to_ray() -> None:
    table = _table()
    joined = pa.concat_tables([table.slice(3, 5), table.slice(20, 4)])
    for name in ("fixed", "list", "large"):
        got = column_tensor(joined.column(name))
        assert torch.equal(got, torch.tensor(joined.column(name).to_pylist(), dtype=got.dtype))
        assert got.shape == (9, 6)
    ragged = pa.array([[1], [2, 3], [4]], pa.list_(pa.int64()))
    assert column_tensor(ragged) is None  # rows of other lengths: Ray's conversion
    assert torch.equal(column_tensor(ragged.slice(0, 1)), torch.tensor([[1]]))  # one row: one length


def test_nulls_outside_the_slice_are_no_nulls_and_inside_it_go_to_ray() -> None:
    values = pa.array([1, 2, None, 4, 5, 6, 7, 8], pa.int32())  # a null in the second row's values
    fixed = pa.FixedSizeListArray.from_arrays(values, 2)
    listed = pa.ListArray.from_arrays(pa.array([0, 2, 4, 6, 8], pa.int32()), values)
    for column in (fixed, listed):
        assert torch.equal(column_tensor(column.slice(2, 2)), torch.tensor([[5, 6], [7, 8]], dtype=torch.int32))
        assert column_tensor(column.slice(1, 2)) is None  # the null is in the slice
        assert column_tensor(column) is None


def test_read_only_views_convert_without_a_warning() -> None:
    data = np.arange(12, dtype=np.int32)
    data.flags.writeable = False
    column = pa.FixedSizeListArray.from_arrays(pa.array(data), 4)  # zero-copy: a read-only view, as a block is
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tensor = column_tensor(column)
    assert not caught, [str(w.message) for w in caught]
    assert torch.equal(tensor, torch.arange(12, dtype=torch.int32).reshape(3, 4))
