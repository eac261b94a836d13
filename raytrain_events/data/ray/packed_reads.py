"""The read-task side of `PackedTokens` (``packed_source.py``): what one Ray read task runs.

`PackedTokens` runs on the driver and in the feeder (windows, counts, the order, which windows each read
task gets: `PackedTokens.reads`); the read tasks run `pack_reads` on the plain values of
`PackedTokens.window_args` (this module imports nothing of the source: a task's worker loads only what it
runs) and return one *compact* block of sequences per task; the ranks expand their rows of it
(``packed_batch.py``). Here: reading a window's token row groups (`window_inputs`: either token layout,
``token_files.py``, as NumPy views of the chunks; the ``packed`` layout through `packed_files.packed_block`),
packing them (`core.packing.pack_runs`, each window on its own, straight into the block) and `pack_read`, one
window's sequences as a table of the batch's columns (tests, benchmarks, the example's checks).
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from raytrain_events.core.packing import PackingError, Runs, pack_runs
from raytrain_events.data.ray.packed_batch import FORMAT_KEY, expand_packed
from raytrain_events.data.ray.packed_files import packed_block
from raytrain_events.data.ray.token_files import flat_arrays

__all__ = ["pack_reads", "pack_read", "window_inputs"]


def pack_reads(windows: List[Dict[str, Any]]) -> Any:
    """A Ray task: read consecutive windows and pack them into one *compact* block of sequences.

    The block holds each sequence's tokens (``input_ids``, a fixed-size list), ``num_tokens``, and
    its documents as runs (``run_documents`` int64, ``run_lengths`` int32: lists, `core.packing.Runs`;
    the ``run_lengths`` column marks the form): about 4 bytes per token instead of the batch's 16
    (`block_bytes`). A rank ships the rows of its batch as segments (`packed_batch.packed_tensors`, in the
    loader) and the loop expands them on the device (`packed_batch.expand_batch`), so the batch the model sees
    is the same as ever. Each window's tokens are packed straight into their rows of the
    block (`pack_runs` with ``out``); the Arrow columns are zero-copy views of those arrays."""
    import pyarrow as pa

    if windows[0].get("layout") == "packed":  # packed offline: views of the bytes read, no packing
        return packed_block(windows)
    inputs = [window_inputs(args) for args in windows]
    seq_len = windows[0]["seq_len"]
    counts = [args["expected"] for args in windows]
    # The token type: the windows hold tokens (the driver counted them), so some chunk does.
    dtype = next(c.dtype for chunks, _, _ in inputs for c in chunks)
    block = np.empty((sum(counts), seq_len), dtype=dtype)
    parts: List[Runs] = []
    at = 0
    for args, (tokens, lengths, ids), count in zip(windows, inputs, counts):
        try:
            runs = pack_runs(
                tokens, lengths, ids, seq_len, args["policy"], args["pad_id"], args["what"], out=block[at : at + count]
            )
        except PackingError as error:  # the driver counted these documents and checked their lengths
            raise PackingError(
                f"{error} The source counted {count} sequences in it when it was built: its files "
                "changed since. Build the source again."
            ) from error
        parts.append(runs)
        at += count
    offsets = np.zeros(len(block) + 1, dtype=np.int32)
    np.cumsum(np.concatenate([p.runs for p in parts]), out=offsets[1:])
    document_format = windows[0].get("document_format", "document_ids")
    return pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), seq_len),
            "num_tokens": pa.array(np.concatenate([p.num_tokens for p in parts])),
            "run_documents": pa.ListArray.from_arrays(pa.array(offsets), np.concatenate([p.documents for p in parts])),
            "run_lengths": pa.ListArray.from_arrays(pa.array(offsets), np.concatenate([p.lengths for p in parts])),
        },
        metadata={FORMAT_KEY: document_format.encode()},  # the rank's batches' format (`packed_batch`)
    )


def pack_read(**args: Any) -> Any:
    """One window's sequences as an Arrow table of the batch's columns (`pack_reads` of that window, expanded)."""
    return expand_packed([pack_reads([args])])[0]


def window_inputs(args: Dict[str, Any]) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray]:
    """Read one window's row groups: ``(its tokens end to end as the decoded chunks, each document's
    length, its id)``, refusing token ids outside the vocabulary.

    The token lists are read as Arrow hands them over: each chunk's flat values and offsets buffers as
    NumPy views (no per-row object, no copy: `pack_runs` copies the chunks straight into the block),
    the lengths from the offsets."""
    import pyarrow.compute as pc

    paths, filesystem, columns = args["paths"], args["filesystem"], args["columns"]
    if args.get("layout") == "flat":
        return _flat_window_inputs(args)
    chunks: List[np.ndarray] = []
    lengths: List[np.ndarray] = []
    ids: List[np.ndarray] = []
    vocab = args["vocab_size"]
    low, high = np.iinfo(np.int64).max, -1  # the tokens' least and greatest id (checked against the vocabulary)
    for table in _row_groups(paths, args["units"], filesystem, columns):
        for chunk in table.column(args["tokens_column"]).chunks:
            if chunk.null_count:  # a null list holds no tokens (its offsets may span some: Arrow allows it)
                lengths.append(pc.fill_null(pc.list_value_length(chunk), 0).to_numpy().astype(np.int64))
                values = chunk.flatten()
            else:
                offsets = chunk.offsets.to_numpy()  # the slice's offsets: len + 1
                lengths.append(np.diff(offsets).astype(np.int64))
                values = chunk.values.slice(offsets[0], offsets[-1] - offsets[0])
            if values.null_count:
                raise ValueError("A token list holds nulls: token ids must all be integers (tokenize again).")
            if vocab is not None and len(values):
                low_high = pc.min_max(values)  # one pass over the tokens
                low, high = min(low, low_high["min"].as_py()), max(high, low_high["max"].as_py())
            chunks.append(values.to_numpy())
        if args["id_column"]:
            ids.append(table.column(args["id_column"]).to_numpy().astype(np.int64))
    length = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    if args["id_column"]:
        document_ids = np.concatenate(ids)
    else:  # each document's row number in the source (a window's row groups are consecutive)
        document_ids = args["bases"][0] + np.arange(len(length), dtype=np.int64)
    if vocab is not None and (high >= vocab or low < 0):
        raise ValueError(
            f"{args['what']} ({paths[args['units'][0][0]]}): token ids {low}..{high} are outside the "
            f"model's vocabulary [0, {vocab}). Fix: tokenize with the model's tokenizer, or a model "
            "with a larger vocab_size."
        )
    return chunks, length, document_ids


def _flat_window_inputs(args: Dict[str, Any]) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray]:
    """`window_inputs` of flat token files: each row group's bytes as NumPy views (`token_files.flat_arrays`), the
    vocabulary checked against each chunk's least and greatest token (no pass over the tokens)."""
    chunks: List[np.ndarray] = []
    lengths: List[np.ndarray] = []
    ids: List[np.ndarray] = []
    paths, units, vocab = args["paths"], args["units"], args["vocab_size"]
    for (f, g), table in zip(units, _row_groups(paths, units, args["filesystem"], args["columns"])):
        tokens, length, document_ids, low, high = flat_arrays(table, f"{paths[f]} row group {g}")
        if vocab is not None and length.any() and (high >= vocab or low < 0):
            raise ValueError(
                f"{args['what']} ({paths[f]} row group {g}): token ids {low}..{high} are outside the model's "
                f"vocabulary [0, {vocab}). Fix: tokenize with the model's tokenizer, or a model with a larger vocab_size."
            )
        chunks += tokens
        lengths.append(length)
        ids.append(document_ids)
    return chunks, np.concatenate(lengths), np.concatenate(ids)


def _row_groups(paths: List[str], units: List[Tuple[int, int]], filesystem: Any, columns: List[str]) -> Iterator[Any]:
    """Each row group of ``units`` (file number, row group) as a table, in order; each file opened once."""
    import pyarrow.parquet as pq

    for f, group in itertools.groupby(units, key=lambda unit: unit[0]):
        with filesystem.open_input_file(paths[f]) if filesystem is not None else open(paths[f], "rb") as handle:
            file = pq.ParquetFile(handle, pre_buffer=True)
            for _, g in group:
                yield file.read_row_group(g, columns=columns)
