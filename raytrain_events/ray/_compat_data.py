"""Ray Data's private names and the object store's byte counters (part of `_compat`'s table, which lists them).

Ray Data: ``Dataset._meta_count()``, ``Dataset._logical_plan`` and its read operators (a bare file read, a
``read_parquet`` followed by column selections), ``Dataset.iter_internal_ref_bundles()`` and Ray Data's NumPy-to-torch
batch conversion: what the data path reads of a dataset without running it. The object store: a raylet's
``GetNodeStats`` reply (bytes created, bytes held), what tests and benchmarks measure the data path's traffic by.
Each use is a function here; `probe_data` and `probe_node_stats` check them all against the installed Ray.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterator, List, Optional, Tuple

from raytrain_events.ray._compat_lookup import _attr, _import, _missing

__all__ = [
    "dataset_meta_count",
    "is_bare_read",
    "iter_block_refs",
    "parquet_read_of",
    "ndarray_batch_to_torch",
    "object_store_created_bytes",
    "object_store_used_bytes",
    "probe_data",
    "probe_node_stats",
]


def dataset_meta_count(dataset: Any) -> Optional[int]:
    """Rows of a Ray Dataset known from metadata alone (never runs anything); None if unknown."""
    return _attr(dataset, "_meta_count")()


def is_bare_read(dataset: Any) -> bool:
    """Whether a Ray Dataset is a plain file read (no map/filter after it), whose count is cheap."""
    read_operator = _import("ray.data._internal.logical.operators", "read_operator")
    reads = tuple(getattr(read_operator, name) for name in ("Read", "ReadFiles") if hasattr(read_operator, name))
    if not reads:
        raise _missing("ray.data._internal.logical.operators.read_operator.Read")
    return isinstance(_attr(_attr(dataset, "_logical_plan"), "dag"), reads)


_PARQUET_READ = ("ReadFiles", "ListFiles", "Project")  # read_operator / map_operator classes read_parquet makes


def parquet_read_of(dataset: Any) -> Optional[Tuple[List[str], Any, Optional[List[str]]]]:
    """``(paths, pyarrow filesystem, columns or None)`` when ``dataset`` is ``ray.data.read_parquet(paths)``
    followed by nothing but column selections (no filter, limit, map, partition filter); else None.

    Conservative: an operator or setting not known here (a future pushdown) gives None, so the
    dataset keeps Ray Data's re-streamed path.
    """
    read_operator = _import("ray.data._internal.logical.operators", "read_operator")
    map_operator = _import("ray.data._internal.logical.operators", "map_operator")
    from ray.data.expressions import ColumnExpr

    op = _attr(_attr(dataset, "_logical_plan"), "dag")
    columns: Optional[List[str]] = None
    while isinstance(op, map_operator.Project):
        exprs = list(op.exprs)
        if not exprs or not all(type(e) is ColumnExpr for e in exprs):
            return None  # a rename, a computed column or an empty selection
        names = [e.name for e in exprs]
        if columns is not None and not set(columns) <= set(names):
            return None
        columns = names if columns is None else columns
        op = op.input_dependencies[0]
    if not isinstance(op, read_operator.ReadFiles) or op.datasource_name != "ParquetV2" or op.block_udf is not None:
        return None
    scanner = op.scanner
    if any(getattr(scanner, n, None) is not None for n in ("predicate", "limit", "shuffle", "partition_predicate")):
        return None  # rows filtered or cut, or files shuffled by Ray per epoch
    if getattr(scanner, "synthesized_columns", ()):
        return None  # include_paths=True and such: columns Ray adds after the read
    if columns is None and getattr(scanner, "columns", None) is not None:
        columns = list(scanner.columns)
    (listing,) = op.input_dependencies
    if not isinstance(listing, read_operator.ListFiles) or listing.input_dependencies:
        return None
    if any(getattr(listing, name, None) is not None for name in ("partition_filter", "predicate", "limit")):
        return None
    if getattr(listing, "partition_pruner", None) is not None:
        return None
    if "parquet" not in (listing.file_extensions or ["parquet"]):
        return None
    return list(listing.paths), listing.filesystem, columns


def iter_block_refs(dataset: Any) -> Iterator[Any]:
    """A Ray Dataset's output as ``RefBundle``s (object refs of blocks with their metadata), in order."""
    return iter(_attr(dataset, "iter_internal_ref_bundles")())


def ndarray_batch_to_torch(batch: Any) -> Any:
    """A (dict of) NumPy array(s) as torch tensors, as Ray Data's ``iter_torch_batches`` converts them."""
    return _import("ray.data.util.torch_utils", "convert_ndarray_batch_to_torch_tensor_batch")(batch)


def object_store_created_bytes(node: Dict[str, Any]) -> int:
    """Bytes of all objects ever created in the object store of ``node`` (an entry of ``ray.nodes()``):
    its workers' outputs and puts, and every object pulled to it from another node."""
    node_stats = _import("ray._private.internal_api", "node_stats")
    reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
    return int(_attr(_attr(reply, "store_stats"), "cumulative_created_bytes"))


def object_store_used_bytes(node: Dict[str, Any]) -> int:
    """Bytes the object store of ``node`` (an entry of ``ray.nodes()``) holds now (``bench/data_scale.py``'s peak)."""
    node_stats = _import("ray._private.internal_api", "node_stats")
    reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
    return int(_attr(_attr(reply, "store_stats"), "object_store_bytes_used"))


def probe_node_stats() -> None:
    node_stats = _import("ray._private.internal_api", "node_stats")
    if "include_memory_info" not in inspect.signature(node_stats).parameters:
        raise _missing("ray._private.internal_api.node_stats(include_memory_info=...)")
    from ray.core.generated import common_pb2, node_manager_pb2

    stats = getattr(node_manager_pb2, "ObjectStoreStats", None) or getattr(common_pb2, "ObjectStoreStats", None)
    if stats is None or "cumulative_created_bytes" not in stats.DESCRIPTOR.fields_by_name:
        raise _missing("ObjectStoreStats.cumulative_created_bytes")
    if "object_store_bytes_used" not in stats.DESCRIPTOR.fields_by_name:
        raise _missing("ObjectStoreStats.object_store_bytes_used")


def probe_data() -> None:
    """Each Ray Data name, read off the class and its source (nothing is executed, Ray need not run)."""
    from ray.data import Dataset

    for name in ("_meta_count", "iter_internal_ref_bundles"):
        if not hasattr(Dataset, name):
            raise _missing(f"ray.data.Dataset.{name}")
    if "self._logical_plan" not in inspect.getsource(Dataset.__init__):
        raise _missing("ray.data.Dataset._logical_plan")
    read_operator = _import("ray.data._internal.logical.operators", "read_operator")
    if not hasattr(read_operator, "Read"):
        raise _missing("ray.data._internal.logical.operators.read_operator.Read")
    _probe_parquet_read()


def _probe_parquet_read() -> None:
    """The dataclass fields `parquet_read_of` reads, off the operator and scanner classes."""
    import dataclasses

    ops = "ray.data._internal.logical.operators"
    wanted = {
        (f"{ops}.read_operator", "ReadFiles"): "datasource_name scanner block_udf input_dependencies",
        (f"{ops}.read_operator", "ListFiles"): "paths filesystem file_extensions partition_filter predicate limit",
        (f"{ops}.map_operator", "Project"): "exprs input_dependencies",
        (
            "ray.data._internal.datasource_v2.common.arrow_file_scanner",
            "ArrowFileScanner",
        ): "columns predicate limit shuffle partition_predicate",
    }
    for (module, name), fields in wanted.items():
        cls = _import(module, name)
        have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        for field in fields.split():
            if field not in have:
                raise _missing(f"{module}.{name}.{field}")
    _import("ray.data.expressions", "ColumnExpr")
