"""Token files' two layouts: ``flat`` (the tokens of many documents end to end, plus their lengths) and ``documents``.

`tokenize` writes ``flat`` by default; `PackedTokens` reads both (each file says its layout in its
footer, `LAYOUT_KEY`; a file without the key is ``documents``, as every token file written before
``flat`` existed).

* ``documents``: one row per document: ``input_ids`` (a list of int32), ``num_tokens``,
  ``document_id``, ``source``. Any Parquet tool reads it as documents; reading it costs Parquet's list
  decoding (repetition and definition levels per token: about what reading the same tokens as
  fixed-length rows costs in all, `bench/packing.py --parts cpu`).
* ``flat``: one row per *chunk* of consecutive documents (a row group holds one chunk of about
  ``group_tokens`` tokens: the seek unit): ``tokens`` (the chunk's token ids end to end, int32
  little-endian bytes), ``lengths`` (int32 per document), ``document_ids`` (int64 per document), as
  ``large_binary`` values, plus ``chunk_tokens``, ``chunk_documents``, ``min_token``, ``max_token``
  (int64/int32 scalars whose footer statistics let the driver check the vocabulary without reading
  tokens) and ``source``. Reading a chunk is a decompression and NumPy views of its bytes
  (`flat_arrays`): no levels, no per-document object. `read_documents` turns either layout back into
  one row per document (for inspection and tests). A flat file is not a table of training rows:
`refuse_token_rows` refuses one passed as plain Parquet (``ParquetRowGroups`` or a bare
``ray.data.read_parquet``) where `RayTrainer` checks its datasets, naming ``PackedTokens``.

Written without dictionary encoding or statistics on the byte columns (a dictionary of whole chunks
is useless, and statistics would copy a chunk's bytes into the footer), and uncompressed by default
(4 bytes per token on disk): decompressing costs more than everything else a pack read does. Per 1024
BPE-like token ids (Zipf-distributed ids under 50,000, chunks of 1 Mi tokens; `tokenize(compression=...)`
for the others), read CPU and size: none 0.9 us and 1.00, lz4 2.4 us and 0.52, zstd 4.9 us and 0.37,
snappy 6.7 us and 0.56 (one run on this 2-core machine, 2026-12-07 04:55 UTC, load about 2).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from raytrain_events.data.ray.parquet_seek import ParquetRowGroups, is_seekable, list_parquet
from raytrain_events.ray import _compat

__all__ = [
    "LAYOUTS",
    "LAYOUT_KEY",
    "VOCAB_KEY",
    "layout_of",
    "refuse_token_rows",
    "flat_schema",
    "flat_table",
    "flat_arrays",
    "FLAT_COLUMNS",
    "flat_values",
    "check_vocabulary",
    "check_layout",
    "check_compression",
    "read_documents",
]

LAYOUTS = ("flat", "documents")
VOCAB_KEY = b"raytrain_events.vocab_size"  # Parquet key-value metadata `tokenize` writes: the tokenizer's vocabulary
LAYOUT_KEY = b"raytrain_events.token_layout"  # Parquet key-value metadata: the file's layout (absent: documents)
FLAT_COLUMNS = ["tokens", "lengths", "document_ids", "min_token", "max_token"]  # what a pack read needs
_SCALARS = ["chunk_tokens", "chunk_documents", "min_token", "max_token"]
TOKEN_DTYPE = np.dtype("<i4")
ID_DTYPE = np.dtype("<i8")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout={layout!r} is not one of {LAYOUTS}: 'flat' (tokens end to end plus document lengths: "
            "the fast read for PackedTokens) or 'documents' (one list row per document, for other tools)."
        )


def check_compression(compression: Optional[str]) -> None:
    """Refuse a Parquet codec this pyarrow cannot write, naming the ones it can."""
    import pyarrow as pa

    if compression is None or compression == "none":
        return
    try:
        ok = pa.Codec.is_available(compression)
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise ValueError(
            f"compression={compression!r} is not a Parquet codec this pyarrow writes: give 'none', 'snappy', 'lz4', "
            "'zstd', 'gzip' or 'brotli'."
        )


def layout_of(schema: Any) -> str:
    """A token file's layout from its (Arrow) schema's metadata: ``"flat"``, ``"documents"`` or ``"packed"``
    (sequences packed offline by `pack_tokens`)."""
    value = (schema.metadata or {}).get(LAYOUT_KEY, b"documents").decode()
    if value not in LAYOUTS + ("packed",):  # packed: sequences packed offline (`pack_tokens.py`)
        raise ValueError(
            f"A token file says layout {value!r}, which this version does not read (it reads {LAYOUTS + ('packed',)}). "
            "Fix: read it with the raytrain_events that wrote it, or tokenize again."
        )
    return value


def flat_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("tokens", pa.large_binary()),
            ("lengths", pa.large_binary()),
            ("document_ids", pa.large_binary()),
            ("chunk_tokens", pa.int64()),
            ("chunk_documents", pa.int64()),
            ("min_token", pa.int32()),
            ("max_token", pa.int32()),
            ("source", pa.string()),
        ],
        metadata={LAYOUT_KEY: b"flat"},
    )


def flat_writer_options(compression: Optional[str] = None) -> Dict[str, Any]:
    """`pyarrow.parquet.ParquetWriter` options of a flat file (see module doc); ``compression``: Parquet's codec
    (default none: see module doc)."""
    return {"use_dictionary": ["source"], "write_statistics": _SCALARS, "compression": compression or "none"}


def flat_table(tokens: np.ndarray, lengths: np.ndarray, document_ids: np.ndarray, source: str) -> Any:
    """One chunk (a row group's one row) of documents: their tokens end to end, lengths and ids."""
    import pyarrow as pa

    tokens = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    lengths = np.ascontiguousarray(lengths, dtype=TOKEN_DTYPE)
    if int(lengths.sum()) != len(tokens) or len(document_ids) != len(lengths):
        raise ValueError(f"{len(tokens)} tokens, {len(lengths)} lengths and {len(document_ids)} ids do not agree.")
    columns = {
        "tokens": [tokens.tobytes()],
        "lengths": [lengths.tobytes()],
        "document_ids": [np.ascontiguousarray(document_ids, dtype=ID_DTYPE).tobytes()],
        "chunk_tokens": [len(tokens)],
        "chunk_documents": [len(lengths)],
        "min_token": [int(tokens.min()) if len(tokens) else 0],
        "max_token": [int(tokens.max()) if len(tokens) else 0],
        "source": [source],
    }
    return pa.table(columns, schema=flat_schema())


def flat_values(column: Any, dtype: np.dtype, what: str) -> List[np.ndarray]:
    """Each chunk of a ``large_binary`` column as one NumPy view of its rows' bytes end to end."""
    out = []
    for chunk in column.chunks:
        if chunk.null_count:
            raise ValueError(f"{what}: a flat token file holds a null chunk: it is corrupt; tokenize again.")
        _, offsets, data = chunk.buffers()
        ends = np.frombuffer(offsets, dtype=np.int64, count=len(chunk) + 1, offset=chunk.offset * 8)
        start, size = int(ends[0]), int(ends[-1] - ends[0])
        if size % dtype.itemsize:
            raise ValueError(f"{what}: {size} bytes are not whole {dtype} values: a corrupt flat token file.")
        out.append(
            np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=start) if size else np.zeros(0, dtype)
        )
    return out


def flat_arrays(table: Any, what: str) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray, int, int]:
    """``(token chunks, lengths int64, document ids int64, least token, greatest token)`` of a flat
    row group's table (`FLAT_COLUMNS`): views of its bytes, no copy of the tokens."""
    tokens = flat_values(table.column("tokens"), TOKEN_DTYPE, what)
    lengths = np.concatenate(flat_values(table.column("lengths"), TOKEN_DTYPE, what) or [np.zeros(0, TOKEN_DTYPE)])
    ids = np.concatenate(flat_values(table.column("document_ids"), ID_DTYPE, what) or [np.zeros(0, ID_DTYPE)])
    if len(ids) != len(lengths) or int(lengths.sum()) != sum(len(t) for t in tokens):
        raise ValueError(f"{what}: its tokens, lengths and ids do not agree: a corrupt flat token file.")
    low = high = None
    if table.num_rows:
        low = int(np.min(table.column("min_token").to_numpy()))
        high = int(np.max(table.column("max_token").to_numpy()))
    return tokens, lengths.astype(np.int64), ids.astype(np.int64), low if low is not None else 0, high or 0


def check_vocabulary(path: str, meta: Any, vocab_size: int, tokens_column: Optional[str]) -> None:
    """Refuse, from one file's footer (``meta``), a tokenizer vocabulary (`VOCAB_KEY`) larger than the model's
    embedding, or token ids outside ``[0, vocab_size)`` (the statistics of ``tokens_column``, a documents-layout
    file's list of ids; None: a flat file's ``min_token``/``max_token``), where the writer kept them."""
    written = (meta.metadata or {}).get(VOCAB_KEY)
    if written is not None and int(written) > vocab_size:
        raise ValueError(
            f"{path} was tokenized with a vocabulary of {int(written)} tokens, more than "
            f"vocab_size={vocab_size} (the model's embedding). Fix: a model with vocab_size >= "
            f"{int(written)}, or tokenize with the model's own tokenizer."
        )
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        low, high = None, None
        for c in range(group.num_columns):
            column = group.column(c)
            name = column.path_in_schema.split(".")[0]
            if not column.is_stats_set or not column.statistics.has_min_max:
                continue
            if name == tokens_column or (tokens_column is None and name == "min_token"):
                low = int(column.statistics.min)
            if name == tokens_column or (tokens_column is None and name == "max_token"):
                high = int(column.statistics.max)
        if (high is not None and high >= vocab_size) or (low is not None and low < 0):
            raise ValueError(
                f"{path} row group {g}: token ids {low}..{high} are outside the model's vocabulary [0, "
                f"{vocab_size}). Fix: tokenize with the model's tokenizer, or a model with a larger vocab_size."
            )


def read_documents(
    path: Any, *, filesystem: Optional[Any] = None, storage_options: Optional[Dict[str, Any]] = None
) -> Any:
    """A token file, folder, URL or list of them (either layout; as `ParquetRowGroups` takes them) as one row per
    document: ``input_ids`` (list of int32), ``num_tokens``, ``document_id``, ``source``, in file and chunk order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, fs = list_parquet(path, filesystem, storage_options)
    tables = []
    for p in paths:
        table = pq.read_table(p, filesystem=fs)
        if layout_of(table.schema) == "documents":
            names = [c for c in ("input_ids", "num_tokens", "document_id", "source") if c in table.column_names]
            tables.append(table.select(names).replace_schema_metadata())
            continue
        for row in range(table.num_rows):
            tokens, lengths, ids, _, _ = flat_arrays(table.slice(row, 1), p)
            flat = np.concatenate(tokens) if tokens else np.zeros(0, TOKEN_DTYPE)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            source = table.column("source")[row].as_py()
            tables.append(
                pa.table(
                    {
                        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(np.int32))),
                        "num_tokens": pa.array(lengths.astype(np.int32)),
                        "document_id": pa.array(ids),
                        "source": pa.array([source] * len(lengths), pa.string()),
                    }
                )
            )
    return pa.concat_tables(tables) if tables else None


def refuse_token_rows(source: Any, name: str = "train") -> None:
    """Refuse flat or packed token files (the ``flat`` layout `tokenize` writes, the ``packed`` one of `pack_tokens`) read as plain
    Parquet rows (``ParquetRowGroups(folder)`` or a bare ``ray.data.read_parquet(folder)``): each of their
    rows is a chunk of many documents' token bytes, not a training row. Known from the footer's layout key
    (`LAYOUT_KEY`): a `ParquetRowGroups`' first footer, read when it was built; for a bare
    ``read_parquet``, its first file's footer (one read). Anything else passes."""
    import pyarrow.parquet as pq

    if isinstance(source, ParquetRowGroups):
        schema, path = source.schema, source.paths[0]
    elif is_seekable(source) or type(source).__module__.split(".")[0] != "ray":
        return  # another seekable source (PackedTokens reads token files itself), or not a Ray Dataset
    else:
        read = _compat.parquet_read_of(source)
        if read is None:
            return
        files, filesystem = list_parquet(read[0], read[1])
        if not files:
            return
        path = files[0]
        if filesystem is None:
            schema = pq.read_schema(path)
        else:
            with filesystem.open_input_file(path) as handle:
                schema = pq.read_schema(handle)
    layout = (schema.metadata or {}).get(LAYOUT_KEY)
    if layout in (b"flat", b"packed"):
        folder = path.rsplit("/", 1)[0] if "/" in path else "."
        what = (
            "a flat token file (`tokenize`'s layout: each row is a chunk of many documents' token bytes"
            if layout == b"flat"
            else "a packed token file (`pack_tokens`' layout: each row is a whole pack window's sequences"
        )
        raise ValueError(
            f"datasets[{name!r}] reads {path} as plain Parquet rows, but it is {what}, not a training row). Fix: "
            f"read it as sequences, datasets={{{name!r}: PackedTokens({folder!r}, seq_len=...)}} "
            "(raytrain_events.data.ray.packed_source)."
        )
