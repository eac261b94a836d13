"""The ``packed`` token layout: pack windows' sequences written once (`pack_tokens`), read with no packing work.

Each row group is one pack window, as one row: ``tokens`` (the window's sequences end to end,
``seq_len`` int32 little-endian each, ``pad_id`` on padding), ``num_tokens`` (int32 per sequence: its
real tokens), ``runs`` (int32 per sequence: its runs), ``run_documents`` (int64 per run: the document
id) and ``run_lengths`` (int32 per run), all ``large_binary``; plus scalars whose footer statistics
let the driver build the source without reading a token (`packed_state`): ``sequences``,
``real_tokens``, ``documents`` (the window's documents, empty ones too), ``pieces`` (its runs),
``min_token``/``max_token`` (of the real tokens: the vocabulary check). The footer's `PACK_KEY`
(JSON) names ``seq_len``, ``policy``, ``window_tokens``, ``pad_id``, the shard's windows and a
fingerprint of its input; `token_files.VOCAB_KEY` is copied from the input. 4 bytes per token
(padding included) plus 12 per run, as the compact block a read task hands on.

A read task (`packed_block`, called by `packed_reads.pack_reads`) reads its windows' row groups and
makes the same compact block the on-the-fly path makes, from NumPy views of the bytes read (no
placement, no gather, no copy of the tokens), after an O(runs) check that the runs tile the
sequences (a corrupt file is refused there, naming the fix).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from raytrain_events.data.ray.packed_batch import FORMAT_KEY
from raytrain_events.data.ray.token_files import ID_DTYPE, LAYOUT_KEY, TOKEN_DTYPE, VOCAB_KEY, flat_values

__all__ = [
    "WRITER_OPTIONS",
    "PACK_KEY",
    "PACKED_COLUMNS",
    "packed_schema",
    "window_table",
    "packed_footers",
    "packed_block",
    "packed_state",
]

PACK_KEY = b"raytrain_events.pack"  # Parquet key-value metadata of a packed file (JSON: how it was packed)
_BYTES = ["tokens", "num_tokens", "runs", "run_documents", "run_lengths"]
_SCALARS = ["sequences", "real_tokens", "documents", "pieces", "min_token", "max_token"]
PACKED_COLUMNS = list(_BYTES)  # what a read task reads
WRITER_OPTIONS = {"use_dictionary": False, "write_statistics": _SCALARS}  # no dictionary, statistics on the scalars
WINDOWS_PER_SHARD = 64  # pack windows per output file (64 windows of 256 * seq_len tokens: 64 MiB at seq_len 1024)


def packed_schema(meta: Dict[bytes, bytes]) -> Any:
    import pyarrow as pa

    fields = [(name, pa.large_binary()) for name in _BYTES]
    fields += [(name, pa.int64()) for name in _SCALARS[:4]] + [(name, pa.int32()) for name in _SCALARS[4:]]
    return pa.schema(fields, metadata={LAYOUT_KEY: b"packed", **meta})


def window_table(runs: Any, documents: int, schema: Any) -> Any:
    """One packed window (`core.packing.Runs`) as a one-row table of the packed layout."""
    import pyarrow as pa

    tokens = np.ascontiguousarray(runs.input_ids, dtype=TOKEN_DTYPE)
    low = high = 0
    if len(runs.lengths):  # the real tokens' least and greatest id (padding is pad_id: not a vocabulary id)
        rows = tokens.reshape(len(runs.num_tokens), -1)
        real = rows[np.arange(rows.shape[1]) < runs.num_tokens[:, None]]
        low, high = int(real.min()), int(real.max())
    columns = {
        "tokens": [tokens.tobytes()],
        "num_tokens": [np.ascontiguousarray(runs.num_tokens, dtype=TOKEN_DTYPE).tobytes()],
        "runs": [np.ascontiguousarray(runs.runs, dtype=TOKEN_DTYPE).tobytes()],
        "run_documents": [np.ascontiguousarray(runs.documents, dtype=ID_DTYPE).tobytes()],
        "run_lengths": [np.ascontiguousarray(runs.lengths, dtype=TOKEN_DTYPE).tobytes()],
        "sequences": [len(runs.num_tokens)],
        "real_tokens": [int(np.sum(runs.num_tokens, dtype=np.int64))],
        "documents": [documents],
        "pieces": [len(runs.lengths)],
        "min_token": [low],
        "max_token": [high],
    }
    return pa.table(columns, schema=schema)


def packed_footers(
    paths: List[str], filesystem: Any
) -> List[Tuple[Dict[str, Any], Optional[bytes], List[Dict[str, int]]]]:
    """Per packed file, from its footer only: ``(how it was packed (PACK_KEY), its VOCAB_KEY, per row group its
    scalars: sequences, real_tokens, documents, pieces, min_token, max_token)``."""
    import pyarrow.parquet as pq

    def one(path: str) -> Tuple[Dict[str, Any], Optional[bytes], List[Dict[str, int]]]:
        if filesystem is None:
            meta = pq.ParquetFile(path).metadata
        else:
            with filesystem.open_input_file(path) as handle:
                meta = pq.ParquetFile(handle).metadata
        kv = meta.metadata or {}
        if kv.get(LAYOUT_KEY) != b"packed" or PACK_KEY not in kv:
            raise ValueError(
                f"{path} is not a packed token file ({kv.get(LAYOUT_KEY, b'documents').decode()!r} layout) among packed "
                "ones: one PackedTokens reads one layout. Fix: pack the whole folder (raytrain-events pack) into its own folder."
            )
        names = [meta.schema.column(c).name for c in range(meta.num_columns)]
        groups = []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            stats = {}
            for name in _SCALARS:
                column = group.column(names.index(name))
                if group.num_rows != 1 or not column.is_stats_set or not column.statistics.has_min_max:
                    raise ValueError(f"{path} row group {g}: no {name} statistics: a corrupt packed file; pack again.")
                stats[name] = int(column.statistics.min)
            groups.append(stats)
        return json.loads(kv[PACK_KEY]), kv.get(VOCAB_KEY), groups

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, paths))


def packed_block(windows: List[Dict[str, Any]]) -> Any:
    """A read task over packed files: the windows' sequences as the compact block `packed_reads.pack_reads`
    makes (``input_ids``, ``num_tokens``, ``run_documents``, ``run_lengths``), from views of the bytes read:
    no placement, no gather, no copy of the tokens (one chunk per window)."""
    import pyarrow as pa

    seq_len = windows[0]["seq_len"]
    tokens, num_tokens, documents, lengths, offsets = [], [], [], [], []
    for args in windows:
        ((f, g),) = args["units"]
        what = f"{args['paths'][f]} row group {g} ({args['what']})"
        table = _read_group(args["paths"][f], g, args["filesystem"])
        one = {name: _one(table, name, ID_DTYPE if name == "run_documents" else TOKEN_DTYPE, what) for name in _BYTES}
        n, runs, run_lengths = args["expected"], one["runs"], one["run_lengths"]
        ends = np.cumsum(runs, dtype=np.int64)
        cum = np.zeros(len(run_lengths) + 1, dtype=np.int64)
        np.cumsum(run_lengths, out=cum[1:])
        if (
            len(one["tokens"]) != n * seq_len
            or len(one["num_tokens"]) != n
            or len(runs) != n
            or int(ends[-1] if n else 0) != len(run_lengths)
            or len(one["run_documents"]) != len(run_lengths)
            or (len(run_lengths) and int(run_lengths.min()) < 1)
            or not np.array_equal(cum[ends] - cum[ends - runs], one["num_tokens"])
            or (n and int(one["num_tokens"].max()) > seq_len)
        ):
            raise ValueError(
                f"{what}: its tokens, runs and sequence counts do not agree with {n} sequences of {seq_len} tokens: "
                "a corrupt packed file. Fix: pack it again (delete the shard, rerun raytrain-events pack)."
            )
        tokens.append(pa.FixedSizeListArray.from_arrays(pa.array(one["tokens"]), seq_len))
        num_tokens.append(one["num_tokens"])
        documents.append(one["run_documents"])
        lengths.append(run_lengths)
        offsets.append(runs)
    at = np.zeros(sum(len(o) for o in offsets) + 1, dtype=np.int32)
    np.cumsum(np.concatenate(offsets), out=at[1:])
    return pa.table(
        {
            "input_ids": pa.chunked_array(tokens),
            "num_tokens": pa.array(np.concatenate(num_tokens)),
            "run_documents": pa.ListArray.from_arrays(pa.array(at), np.concatenate(documents)),
            "run_lengths": pa.ListArray.from_arrays(pa.array(at), np.concatenate(lengths)),
        },
        metadata={FORMAT_KEY: windows[0].get("document_format", "document_ids").encode()},  # the rank's batches'
    )


def _one(table: Any, name: str, dtype: np.dtype, what: str) -> np.ndarray:
    values = flat_values(table.column(name), dtype, what)
    if len(values) != 1:
        raise ValueError(f"{what}: {len(values)} chunks of {name}: a corrupt packed file (one row per row group).")
    return values[0]


def packed_state(  # noqa: PLR0913 (the files, then what the reader asked for)
    paths: List[str],
    filesystem: Any,
    seq_len: int,
    policy: str,
    window_tokens: Optional[int],
    pad_id: int,
    vocab_size: Optional[int],
) -> Dict[str, Any]:
    """A packed folder from its footers only (no token read), each row group one window: ``{window_tokens,
    sequences, pieces, documents, real_tokens}`` (the last four per row group, in order). Refuses files
    packed for another ``seq_len``, policy, ``window_tokens`` (when given) or ``pad_id`` than asked, or
    than each other, and with ``vocab_size`` token ids outside ``[0, vocab_size)``."""
    footers = packed_footers(paths, filesystem)
    asked = {"seq_len": seq_len, "policy": policy, "window_tokens": window_tokens, "pad_id": pad_id}
    first = {k: footers[0][0][k] for k in asked}
    for path, (how, vocab, groups) in zip(paths, footers):
        made = {k: how[k] for k in asked}
        if made != first:
            raise ValueError(
                f"{path} was packed with {made}, {paths[0]} with {first}: one folder, one packing. "
                "Fix: pack the tokens again into one folder with one set of options."
            )
        wrong = [k for k, v in asked.items() if v is not None and v != made[k]]
        if wrong:
            fix = ", ".join(f"{k}={made[k]!r}" for k in wrong)
            raise ValueError(
                f"{path} holds sequences packed with {fix}, not {', '.join(f'{k}={asked[k]!r}' for k in wrong)} "
                f"as asked. Fix: PackedTokens(..., {fix}), or pack the tokens again with the options you want "
                "(raytrain-events pack TOKENS OUT --seq-len N --policy P), or read the token folder itself "
                "(packed on the fly)."
            )
        if vocab_size is not None:
            _check_vocabulary(path, vocab, groups, vocab_size)
    stats = [g for _, _, groups in footers for g in groups]
    if not stats or not all(g["sequences"] for g in stats):
        raise ValueError(f"PackedTokens: {paths[:3]} hold a window of no sequence: a corrupt packed folder.")
    out: Dict[str, Any] = {k: [g[k] for g in stats] for k in ("sequences", "pieces", "documents", "real_tokens")}
    return {**out, "window_tokens": first["window_tokens"]}


def _check_vocabulary(path: str, vocab: Optional[bytes], groups: List[Dict[str, int]], vocab_size: int) -> None:
    if vocab is not None and int(vocab) > vocab_size:
        raise ValueError(
            f"{path} was tokenized with a vocabulary of {int(vocab)} tokens, more than vocab_size={vocab_size} "
            f"(the model's embedding). Fix: a model with vocab_size >= {int(vocab)}, or the model's own tokenizer."
        )
    for g, stats in enumerate(groups):
        if stats["pieces"] and (stats["max_token"] >= vocab_size or stats["min_token"] < 0):
            raise ValueError(
                f"{path} row group {g}: token ids {stats['min_token']}..{stats['max_token']} are outside the "
                f"model's vocabulary [0, {vocab_size}). Fix: tokenize with the model's tokenizer, or a larger vocab_size."
            )


def _read_group(path: str, g: int, filesystem: Any) -> Any:
    import pyarrow.parquet as pq

    with filesystem.open_input_file(path) if filesystem is not None else open(path, "rb") as handle:
        return pq.ParquetFile(handle).read_row_group(g, columns=PACKED_COLUMNS)
