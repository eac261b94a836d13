"""Pack token documents offline, once (`pack_tokens`, ``raytrain-events pack``): the ``packed`` layout.

``pack_tokens("tokens/web", "packed/web", seq_len=1024, policy="best_fit")`` (or ``raytrain-events
pack tokens/web packed/web --seq-len 1024 --policy best_fit``) packs a token folder (`tokenize`'s
output, either layout) into the very sequences `PackedTokens` would pack on the fly for that
``seq_len``, policy, ``window_tokens`` and ``pad_id``: the same pack windows (consecutive row groups,
`packed_source.PackedTokens._cut_windows`), each packed by the same pure placement
(`core.packing.pack_runs`). ``PackedTokens("packed/web", seq_len=1024, policy="best_fit")`` then
reads them with no placement and no gather: a read task's work is NumPy views of the bytes it read,
the rank's the same run expansion as ever. Worth it for ``best_fit`` (its placement and gather cost
more per sequence than reading fixed-length rows, `bench/packing.py --parts cpu`); ``concat`` packs
fast on the fly (a copy), so pre-packing it saves little.

The layout (`packed_files.py`): each row group one window's sequences (the tokens, ``pad_id`` on
padding, and the runs: each document piece's id and length), ``seq_len``, policy, ``window_tokens``
and ``pad_id`` in the footer with each window's counts.

Shards: ``output/part-<NNNNN>.parquet``, ``windows_per_shard`` consecutive windows each, written
through a temporary name renamed on success (`tokenize._shard_file`), by ``workers`` threads (the
placement is Python and holds the GIL, so threads overlap mostly the reads and the writes: for a
corpus beyond one machine's hour, run one `pack_tokens` per source or per slice of its files; the
throughput of one process: `bench/packing.py --parts cpu`).
Resumable: a shard exists only once complete, so a rerun does the missing ones. Idempotent: a rerun
with the same input and options writes nothing; a shard of another input or other options is
refused, naming the fix, never mixed.
"""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.core.packing import check_policy, pack_runs
from raytrain_events.data.ray.packed_files import PACK_KEY, WRITER_OPTIONS, packed_schema, window_table
from raytrain_events.data.ray.packed_reads import window_inputs
from raytrain_events.data.ray.packed_source import PackedTokens
from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
from raytrain_events.data.ray.token_files import VOCAB_KEY, check_compression
from raytrain_events.data.ray.tokenize import _fs, _join, _shard_file

__all__ = ["pack_tokens", "WINDOWS_PER_SHARD"]

WINDOWS_PER_SHARD = 64  # pack windows per output file (64 windows of 256 * seq_len tokens: 64 MiB at seq_len 1024)


def pack_tokens(  # noqa: PLR0913 (input and output, then keyword-only options, each documented)
    tokens: Any,
    output: str,
    *,
    seq_len: int,
    policy: str = "best_fit",
    window_tokens: Optional[int] = None,
    pad_id: int = 0,
    windows_per_shard: int = WINDOWS_PER_SHARD,
    workers: int = 4,
    compression: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Pack the token documents of ``tokens`` (a folder, files or a glob of `tokenize`'s output, as
    `PackedTokens` takes them) into ``output`` in the packed layout (module doc). ``seq_len``,
    ``policy``, ``window_tokens`` (default ``256 * seq_len``) and ``pad_id``: as `PackedTokens`'.
    Returns ``{"written", "skipped", "windows", "sequences", "real_tokens", "documents"}``; then
    ``PackedTokens(output, seq_len=seq_len, policy=policy)`` reads the sequences."""

    check_policy(policy, seq_len)
    check_compression(compression)
    if windows_per_shard < 1 or workers < 1:
        raise ValueError(f"windows_per_shard={windows_per_shard}, workers={workers}: give integers >= 1.")
    parquet = ParquetRowGroups(tokens, storage_options=storage_options)
    source = PackedTokens(parquet, seq_len=seq_len, policy=policy, window_tokens=window_tokens, pad_id=pad_id)
    if source.layout == "packed":
        raise ValueError(f"{tokens!r} is already packed: pack_tokens packs token folders (tokenize's output).")
    vocab = _vocab_of(source)
    options = {"seq_len": seq_len, "policy": policy, "window_tokens": source.window_tokens, "pad_id": pad_id}
    shards = [
        list(range(a, min(a + windows_per_shard, len(source.windows))))
        for a in range(0, len(source.windows), windows_per_shard)
    ]
    _refuse_extra_shards(output, len(shards), storage_options)
    todo: List[Tuple[str, List[int], Dict[bytes, bytes]]] = []
    for k, windows in enumerate(shards):
        out = _join(output, f"part-{k:05d}.parquet")
        meta = {
            PACK_KEY: json.dumps(
                {**options, "windows": [windows[0], windows[-1] + 1], "input": _fingerprint(source, windows)}
            ).encode()
        }
        if vocab is not None:
            meta[VOCAB_KEY] = vocab
        if not _done(out, meta[PACK_KEY], storage_options):
            todo.append((out, windows, meta))

    def run(item: Tuple[str, List[int], Dict[bytes, bytes]]) -> None:
        _write_shard(source, *item, compression=compression, storage_options=storage_options)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, todo))
    return {
        "written": len(todo),
        "skipped": len(shards) - len(todo),
        "windows": len(source.windows),
        "sequences": source.count(),
        "real_tokens": source.real_tokens,
        "documents": source.documents,
    }


def _refuse_extra_shards(output: str, shards: int, storage_options: Optional[Dict[str, Any]]) -> None:
    """Refuse shards in ``output`` past this job's ``shards`` (left by a job over more input): read with the
    others they would add sequences this input does not pack into."""

    fs, at = _fs(output, storage_options)
    if not fs.exists(at):
        return
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(at, detail=False))
    extra = [
        n for n in names if n.endswith(".parquet") and not any(n == f"part-{k:05d}.parquet" for k in range(shards))
    ]
    if extra:
        raise FileExistsError(
            f"{output} holds {extra[:3]} besides this job's {shards} shards (from a job over other input?): "
            "PackedTokens would read them too. Fix: another output folder, or delete them."
        )


def _vocab_of(source: Any) -> Optional[bytes]:
    import pyarrow.parquet as pq

    path = source.paths[0]
    if source.filesystem is None:
        meta = pq.read_schema(path).metadata or {}
    else:
        with source.filesystem.open_input_file(path) as handle:
            meta = pq.read_schema(handle).metadata or {}
    return meta.get(VOCAB_KEY)


def _fingerprint(source: Any, windows: List[int]) -> str:
    """The input of these windows: each one's row groups (file name, row group) and its sequence count."""
    parts = []
    for w in windows:
        a, b = source.windows[w]
        parts.append(
            [[source.paths[f].rsplit("/", 1)[-1], g] for f, g in source.units[a:b]] + [source.window_sequences[w]]
        )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _done(output: str, want: bytes, storage_options: Optional[Dict[str, Any]]) -> bool:
    """Whether shard ``output`` exists and holds these windows packed this way (refusing one packed otherwise)."""
    import pyarrow.parquet as pq

    fs, at = _fs(output, storage_options)
    if not fs.exists(at):
        return False
    with fs.open(at, "rb") as handle:
        written = (pq.read_schema(handle).metadata or {}).get(PACK_KEY, b"")
    if written != want:
        raise FileExistsError(
            f"{output} already holds sequences packed from another input or with other options ({written[:200]!r}), "
            f"not {want[:200]!r}. Fix: another output folder, or delete it to redo."
        )
    return True


def _write_shard(  # noqa: PLR0913 (the source, the shard, how to write it)
    source: Any,
    output: str,
    windows: List[int],
    meta: Dict[bytes, bytes],
    *,
    compression: Optional[str],
    storage_options: Optional[Dict[str, Any]],
) -> None:
    """Pack ``windows`` of ``source`` (a `PackedTokens` over token files) into shard ``output``, one row group each."""
    import pyarrow.parquet as pq

    schema = packed_schema(meta)
    options = {**WRITER_OPTIONS, "compression": compression or "none"}
    with _shard_file(output, storage_options) as tmp, pq.ParquetWriter(tmp, schema, **options) as writer:
        for w in windows:
            args = source.window_args(w)
            chunks, lengths, ids = window_inputs(args)
            runs = pack_runs(chunks, lengths, ids, source.seq_len, source.policy, source.pad_id, args["what"])
            if len(runs.num_tokens) != source.window_sequences[w]:
                raise RuntimeError(
                    f"{args['what']}: {len(runs.num_tokens)} sequences, the driver counted {source.window_sequences[w]}."
                )
            writer.write_table(window_table(runs, len(lengths), schema))
