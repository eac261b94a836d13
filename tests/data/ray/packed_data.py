"""Token Parquet for the packing tests: documents of a long-tail length mix, each token naming its
document and place (so a test can check every document's tokens once per epoch from the batches)."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np

VOCAB = 4096


def doc_tokens(doc: int, length: int) -> np.ndarray:
    """Document ``doc``'s tokens: ids below `VOCAB` that differ between neighbouring documents."""
    return ((np.arange(length) * 7 + doc * 13) % (VOCAB - 1) + 1).astype(np.int32)


def write_tokens(
    folder: str,
    files: int,
    groups: int,
    docs_per_group: int,
    seed: int,
    first_id: int = 0,
    longest: int = 40,
    with_columns: bool = True,
    layout: str = "documents",
) -> Tuple[List[str], Dict[int, int]]:
    """``files`` Parquet files of ``groups`` row groups of ``docs_per_group`` documents each (lengths
    1..``longest`` from a Zipf tail, a few empty); returns the paths and each document's length.
    ``layout="flat"``: the same documents as `tokenize` writes by default (a row group one chunk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths: Dict[int, int] = {}
    paths = []
    doc = first_id
    for f in range(files):
        n = groups * docs_per_group
        sizes = np.minimum(rng.zipf(1.5, size=n), longest)
        sizes[rng.random(n) < 0.02] = 0
        ids = np.arange(doc, doc + n)
        columns = {
            "input_ids": pa.array([doc_tokens(int(i), int(k)) for i, k in zip(ids, sizes)], type=pa.list_(pa.int32()))
        }
        if with_columns:
            columns.update(document_id=pa.array(ids, pa.int64()), num_tokens=pa.array(sizes, pa.int32()))
        path = os.path.join(folder, f"part-{f:02d}.parquet")
        if layout == "flat":
            _write_flat(path, columns["input_ids"], sizes, ids, docs_per_group)
        else:
            pq.write_table(pa.table(columns), path, row_group_size=docs_per_group)
        paths.append(path)
        lengths.update(zip(ids.tolist(), sizes.tolist()))
        doc += n
    return paths, lengths


def _write_flat(path: str, tokens, sizes, ids, docs_per_group: int) -> None:
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.token_files import flat_schema, flat_table, flat_writer_options

    with pq.ParquetWriter(path, flat_schema(), **flat_writer_options()) as writer:
        for at in range(0, len(sizes), docs_per_group):
            part = tokens.slice(at, docs_per_group)
            flat = part.values.slice(part.offsets[0].as_py(), part.offsets[-1].as_py() - part.offsets[0].as_py())
            writer.write_table(
                flat_table(flat.to_numpy(), sizes[at : at + docs_per_group], ids[at : at + docs_per_group], "s")
            )


def pieces_of(batches) -> Dict[int, List[int]]:
    """Per document id, every token position trained (from ``document_ids``/``input_ids`` of packed batches)."""
    out: Dict[int, List[int]] = {}
    for batch in batches:
        docs, ids = np.asarray(batch["document_ids"]), np.asarray(batch["input_ids"])
        for row_docs, row_ids in zip(docs, ids):
            for d in np.unique(row_docs[row_docs >= 0]):
                out.setdefault(int(d), []).extend(row_ids[row_docs == d].tolist())
    return out


def expected_pieces(lengths: Dict[int, int]) -> Dict[int, List[int]]:
    return {d: doc_tokens(d, k).tolist() for d, k in lengths.items() if k}
