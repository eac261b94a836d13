"""A rank's part of a batch of packed sequences (`packed_reads.pack_reads`' compact blocks) expanded
to the public columns: ``input_ids``, ``document_ids`` (int64), ``position_ids`` (int32), ``num_tokens``;
or, under ``PackedTokens(document_format="cu_seqlens")`` (`DOCUMENT_FORMATS`), ``input_ids``,
``cu_seqlens``, ``max_seqlen``, ``num_tokens`` (`cu_seqlens_of`: O(runs + sequences), nothing per token).

Three forms of the same batch:

* `packed_tensors(parts, expand=False)`, the train loader's (`loader.GlobalOrderLoader`, no
  ``collate_fn``): the ``document_ids`` format as *segments* (`core.segments.SEGMENT_COLUMNS`: each run and each
  sequence's padding, `core.segments.Segments`, O(runs + sequences) numbers made on the host) beside
  ``input_ids`` and ``num_tokens``; the loop moves it to the device, where `expand_batch` (the
  loader's ``device_transforms``, which `DataSpec` runs before the user's) makes the per-token
  columns: a few kernels on an accelerator instead of 12 bytes per token written by the host.
* `packed_tensors(parts)`: the public columns as tensors, expanded on the host (`core.packing.expand_runs`,
  O(tokens) array work) with no Arrow table built to be converted again.
* `expand_packed`: an Arrow table of the public columns (for ``collate_fn``, through Ray's NumPy batch
  format, and for `pack_read`).

The run lists are read as NumPy views of their Arrow buffers, the tokens themselves not copied (a
batch within one block is a view of it, as for any source; one spanning two blocks is joined once).
``document_ids``/``position_ids`` are new arrays per batch: nothing a later batch writes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from raytrain_events.core.packing import expand_runs
from raytrain_events.core.segments import SEGMENT_COLUMNS, expand_segments_torch, is_segmented, run_segments
from raytrain_events.data.ray.batch_tensors import column_tensor, from_numpy

__all__ = [
    "expand_packed",
    "packed_tensors",
    "expand_batch",
    "is_packed",
    "cu_seqlens_of",
    "DOCUMENT_FORMATS",
    "FORMAT_KEY",
    "SEGMENT_COLUMNS",
]

DOCUMENT_FORMATS = ("document_ids", "cu_seqlens")  # `PackedTokens(document_format=...)`: what a batch carries
FORMAT_KEY = b"raytrain_events.document_format"  # a compact block's schema metadata: its batches' format


def document_format(parts: List[Any]) -> str:
    """The document format of compact packed ``parts`` (`FORMAT_KEY`; a block without it: ``"document_ids"``)."""
    meta = parts[0].schema.metadata or {}
    return meta.get(FORMAT_KEY, b"document_ids").decode()


def is_packed(parts: List[Any]) -> bool:
    """Whether ``parts`` (a batch's Arrow tables) are all compact packed blocks (`pack_reads`)."""
    return bool(parts) and all(isinstance(p, pa.Table) and "run_lengths" in p.column_names for p in parts)


def packed_tensors(parts: List[Any], *, expand: bool = True) -> Optional[Dict[str, Any]]:
    """``{column: tensor}`` of the batch of ``parts`` (compact packed blocks), as `table_to_torch` of
    `expand_packed`'s table gives it (the same dtypes, shapes, values and column order) without
    building that table. ``expand=False`` (the train loader's): a ``document_ids`` batch comes as
    ``input_ids``, its segments (`SEGMENT_COLUMNS`) and ``num_tokens``, for `expand_batch` to finish
    on the device (a ``cu_seqlens`` batch is the same either way). None when the parts are not
    packed blocks: the caller converts them as any table."""
    if not is_packed(parts):
        return None
    input_ids, documents, lengths, runs, counts = _runs(parts)
    one = len(input_ids) == 1  # within one block: a view of it
    tokens = column_tensor(
        input_ids[0] if one else pa.chunked_array(input_ids, parts[0].schema.field("input_ids").type)
    )
    if tokens is None:  # not a list of numbers without nulls: the table path decides
        return None
    seq_len = parts[0].schema.field("input_ids").type.list_size  # a fixed-size list (`pack_reads`)
    if document_format(parts) == "cu_seqlens":
        cu_seqlens, max_seqlen = cu_seqlens_of(lengths, runs, counts, seq_len)
        return {
            "input_ids": tokens,
            "cu_seqlens": from_numpy(cu_seqlens),
            "max_seqlen": from_numpy(np.array(max_seqlen, dtype=np.int32)),
            "num_tokens": from_numpy(counts),
        }
    if not expand:
        segments = run_segments(documents, lengths, runs, counts, seq_len)
        return {
            "input_ids": tokens,
            **dict(zip(SEGMENT_COLUMNS, map(from_numpy, segments))),
            "num_tokens": from_numpy(counts),
        }
    document_ids, position_ids = expand_runs(documents, lengths, runs, counts, seq_len)
    return {
        "input_ids": tokens,
        "document_ids": from_numpy(document_ids),
        "position_ids": from_numpy(position_ids),
        "num_tokens": from_numpy(counts),
    }


def expand_batch(batch: Any) -> Any:
    """A batch of `packed_tensors(..., expand=False)` with its per-token ``document_ids`` (int64) and
    ``position_ids`` (int32) made from its segments on the batch's device
    (`core.segments.expand_segments_torch`): the very batch `packed_tensors(...)` gives (the same
    columns, order, dtypes, shapes and values). Any other batch as it is (one key lookup)."""
    if not is_segmented(batch):
        return batch
    tokens = batch["input_ids"]
    rows, seq_len = tokens.shape
    document_ids, position_ids = expand_segments_torch(*(batch[k] for k in SEGMENT_COLUMNS), rows, seq_len)
    return {
        "input_ids": tokens,
        "document_ids": document_ids,
        "position_ids": position_ids,
        "num_tokens": batch["num_tokens"],
    }


def cu_seqlens_of(
    lengths: np.ndarray, runs: np.ndarray, num_tokens: np.ndarray, seq_len: int
) -> Tuple[np.ndarray, int]:
    """``(cu_seqlens int32, max_seqlen)`` of sequences given as runs (`core.packing.Runs`' ``lengths``,
    ``runs``, ``num_tokens``): the cumulative lengths of the batch's segments over its rows laid end
    to end (``rows * seq_len`` tokens), each run one segment and each sequence's padding (after its
    ``num_tokens``) one more, so ``cu_seqlens[-1] == rows * seq_len`` (flash-attn's varlen layout over
    the flattened ``input_ids``); ``max_seqlen``: the longest segment. O(runs + sequences)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pad = seq_len - np.asarray(num_tokens, dtype=np.int32)
    padded = np.flatnonzero(pad)
    if len(padded):  # each padded sequence's padding after its last run
        lengths = np.insert(lengths, np.cumsum(runs, dtype=np.intp)[padded], pad[padded])
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    if int(cu[-1]) != len(runs) * seq_len:
        raise ValueError(
            f"runs of {int(cu[-1])} tokens do not tile {len(runs)} x seq_len={seq_len}: a corrupt packed block."
        )
    return cu, int(lengths.max()) if len(lengths) else 0


def expand_packed(parts: List[Any]) -> List[Any]:
    """The parts of a batch (Arrow tables), compact packed blocks (`pack_reads`) joined and expanded
    to the public columns as one table (see module doc); any other parts as they are."""
    if not is_packed(parts):
        return parts
    if document_format(parts) == "cu_seqlens":
        return [_cu_seqlens_table(parts)]
    input_ids, document_ids, position_ids, _ = _expand(parts)
    seq_len = document_ids.shape[1]

    def fixed(values: np.ndarray) -> Any:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), seq_len)

    num_tokens = pa.chunked_array([c for p in parts for c in p.column("num_tokens").chunks], pa.int32())
    columns = {"input_ids": pa.chunked_array(input_ids, parts[0].schema.field("input_ids").type)}
    columns.update(document_ids=fixed(document_ids), position_ids=fixed(position_ids), num_tokens=num_tokens)
    return [pa.table(columns)]


def _cu_seqlens_table(parts: List[Any]) -> Any:
    """The table form of a ``cu_seqlens`` batch: per row its own ``cu_seqlens`` (``0 .. seq_len``, a list;
    the batch's tensor is these laid end to end over the rows), ``input_ids`` and ``num_tokens`` as ever."""
    seq_len = parts[0].schema.field("input_ids").type.list_size
    tokens, _, lengths, runs, counts = _runs(parts)
    cu, _ = cu_seqlens_of(lengths, runs, counts, seq_len)
    n = len(runs)
    per_row = runs.astype(np.intp) + (counts < seq_len) + 1  # each row's segments, and its leading 0
    row = np.repeat(np.arange(n, dtype=np.intp), per_row)
    values = cu[np.arange(len(row), dtype=np.intp) - row] - (row * seq_len).astype(np.int32)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(per_row, out=offsets[1:])
    return pa.table(
        {
            "input_ids": pa.chunked_array(tokens, parts[0].schema.field("input_ids").type),
            "cu_seqlens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())),
            "num_tokens": pa.array(counts, pa.int32()),
        }
    )


def _expand(parts: List[Any]) -> Tuple[List[Any], np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids' chunks, document_ids, position_ids, num_tokens)`` of packed ``parts``."""
    seq_len = parts[0].schema.field("input_ids").type.list_size  # a fixed-size list (`pack_reads`)
    tokens, documents, lengths, runs, counts = _runs(parts)
    document_ids, position_ids = expand_runs(documents, lengths, runs, counts, seq_len)
    return tokens, document_ids, position_ids, counts


def _runs(parts: List[Any]) -> Tuple[List[Any], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids' chunks, run documents, run lengths, runs per sequence, num_tokens)`` of packed ``parts``.

    Each part's columns are taken once (not looked up by name per column), and each ``run_lengths``
    chunk's offsets are read once (its values' span and each sequence's run count both come from
    them): per-call work is most of a small part's cost (a rank's part of a batch is a few
    sequences at scale)."""
    tokens: List[Any] = []
    documents: List[np.ndarray] = []
    lengths: List[np.ndarray] = []
    runs: List[np.ndarray] = []
    num_tokens: List[np.ndarray] = []
    for part in parts:
        columns = dict(zip(part.column_names, part.columns))
        tokens += columns["input_ids"].chunks
        num_tokens += [chunk.to_numpy() for chunk in columns["num_tokens"].chunks]
        for lens in columns["run_lengths"].chunks:
            offsets = lens.offsets.to_numpy()  # the chunk's (a slice's) own offsets, len + 1
            lengths.append(lens.values.to_numpy()[offsets[0] : offsets[-1]])
            runs.append(np.diff(offsets))
        documents += [_list_values(chunk) for chunk in columns["run_documents"].chunks]
    counts = _joined(num_tokens, np.int32)
    return tokens, _joined(documents, np.int64), _joined(lengths, np.int32), _joined(runs, np.int32), counts


def _list_values(chunk: Any) -> np.ndarray:
    """A list chunk's flat values: a NumPy view of its values buffer between its first and last offset."""
    offsets = chunk.offsets.to_numpy()
    return chunk.values.to_numpy()[offsets[0] : offsets[-1]]


def _joined(pieces: List[np.ndarray], dtype: Any) -> np.ndarray:
    if not pieces:  # no rows
        return np.zeros(0, dtype=dtype)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
