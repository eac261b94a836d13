"""Tokenize text once on the cluster: text Parquet/JSONL into seekable token Parquet (`tokenize`).

``tokenize({"web": "text/web/", "code": "s3://bucket/code/*.jsonl"}, "s3://bucket/tokens/",
tokenizer="bpe.json", storage_options={...})`` (or ``raytrain-events tokenize``) writes, per source,
one token Parquet shard per input file:
``tokens/<source>/part-<NNNNN>.parquet``, in one of two layouts (`token_files.py`): ``flat`` (the
default: each row group one chunk of documents, their tokens end to end plus their lengths and ids,
which `PackedTokens` reads as NumPy views with no per-document decoding) or ``documents``
(``layout="documents"``: one row per document, ``input_ids`` a list of int32, ``num_tokens``,
``document_id``, ``source``, for other Parquet tools; `PackedTokens` reads it too, at about twice the
read cost). Either way each document keeps its id (the input's id column when named, else ``file
number * 2**32 + row``, stable across reruns) and its source; `token_files.read_documents` reads
either layout back as one row per document. Inputs and output are local
paths or fsspec URLs (``s3://``, ``gs://``, ...; ``storage_options`` for the filesystem, the same
for both). Each shard's footer records the tokenizer's vocabulary size (`token_files.VOCAB_KEY`,
checked against the model by `PackedTokens(vocab_size=...)` before training), the tokenizer's
fingerprint and its input file.
Row groups hold about ``group_tokens`` tokens (default 1 Mi, 4 MiB of ids): the seek unit of
`ParquetRowGroups`/`PackedTokens` (a resume reads at most one row group before its position) and a
fraction of the seekable path's 16 MiB reads.

The tokenizer (`text_tokenizer.py`): a ``tokenizer.json`` file (Hugging Face ``tokenizers``), or a
folder a ``transformers`` tokenizer was saved to, or the name of one in the local Hugging Face
cache; nothing is downloaded. It must be readable where the tasks run (the same path on every node).

The job runs on Ray Data: the input files not yet done become a dataset of file names, ``map``-ed
by tasks (``num_cpus`` each) that each read one input file in batches, encode them (the tokenizer
loaded once per task; ``tokenizers``' Rust encoder batches the texts) and write the shard through a
temporary name renamed on success (on an object store: written locally, then uploaded whole; the
object exists only once the upload completes). Resumable: a shard
exists only once complete, so a rerun after a failure does the files whose shards are missing.
Idempotent: a rerun over the same inputs with the same tokenizer writes nothing (each existing
shard's footer names its input and tokenizer; a shard made from another input or tokenizer is
refused, naming the fix, never silently mixed). Per-file tasks rather than
``Dataset.write_parquet`` (whose file names are fresh on every run, so a rerun could neither skip
finished work nor avoid duplicates); the unit of parallelism is the input file.

Documents: text that encodes to no tokens (empty, or nothing the tokenizer keeps) is skipped and
counted (``empty``); ``max_tokens`` cuts longer documents to that many tokens, counted
(``truncated``); ``eos`` appends that token to each document. Refused before any task runs: a text
column that is missing or not text (string), a missing tokenizer (file, folder or cached name), an
``eos`` that is not one of its tokens, and with ``vocab_size`` (the model's embedding rows) a
tokenizer of more ids than that.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from raytrain_events.data.ray.text_tokenizer import load_tokenizer
from raytrain_events.data.ray.token_files import (
    LAYOUT_KEY,
    check_compression,
    check_layout,
    flat_schema,
    flat_table,
    flat_writer_options,
)

__all__ = ["tokenize", "tokenize_file", "GROUP_TOKENS"]

GROUP_TOKENS = 1 << 20  # tokens per row group of the output
_BATCH_ROWS = 1024  # documents encoded at once
_META = {
    "vocab": b"raytrain_events.vocab_size",
    "tokenizer": b"raytrain_events.tokenizer_sha256",
    "input": b"raytrain_events.input",
}


def _local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _fs(url: str, storage_options: Optional[Dict[str, Any]]) -> Tuple[Any, str]:
    # why here: defers fsspec until this runs
    from raytrain_events.storage.fs import resolve

    return resolve(url, storage_options if not _local(url) else None)


def _inputs(paths: Union[str, Sequence[str]], storage_options: Optional[Dict[str, Any]] = None) -> List[str]:
    """Input files: each path a file, a folder (its .parquet/.jsonl/.json files, sorted) or a glob,
    local or an fsspec URL (``s3://bucket/text/``, with ``storage_options``)."""
    out: List[str] = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        fs, at = _fs(path, storage_options)
        if fs.isdir(at):
            found = sorted(
                p
                for p in fs.find(at)
                if p.endswith((".parquet", ".jsonl", ".json")) and not p.rsplit("/", 1)[-1].startswith((".", "_"))
            )
        else:
            found = sorted(fs.glob(at)) if any(c in at for c in "*?[") else [at] if fs.isfile(at) else []
        if not found:
            raise FileNotFoundError(
                f"tokenize found no .parquet/.jsonl input at {path!r}: give files, folders or globs "
                "(local, or URLs such as s3://bucket/text/ with storage_options)."
            )
        out += [os.path.abspath(p) if _local(path) else fs.unstrip_protocol(p) for p in found]
    return out


def _join(folder: str, *parts: str) -> str:
    return os.path.join(folder, *parts) if _local(folder) else "/".join([folder.rstrip("/"), *parts])


@contextlib.contextmanager
def _opened(url: str, storage_options: Optional[Dict[str, Any]]) -> Iterator[Any]:
    fs, at = _fs(url, storage_options)
    with fs.open(at, "rb") as handle:
        yield handle


def _batches(path: str, columns: List[str], storage_options: Optional[Dict[str, Any]] = None) -> Iterator[Any]:
    """Record batches of ``columns`` of one input file (Parquet, or JSON lines)."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    with _opened(path, storage_options) as handle:
        if path.endswith(".parquet"):
            yield from pq.ParquetFile(handle).iter_batches(batch_size=_BATCH_ROWS, columns=columns)
            return
        yield from pj.read_json(handle).select(columns).to_batches(max_chunksize=_BATCH_ROWS)


def _schema_of(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Any:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    with _opened(path, storage_options) as handle:
        return pq.read_schema(handle) if path.endswith(".parquet") else pj.read_json(handle).schema


def check_text_columns(
    files: Sequence[str], text_column: str, id_column: Optional[str], storage_options: Optional[Dict[str, Any]] = None
) -> None:
    """Refuse an input without the text column, or whose text column is not text, before any task runs."""
    import pyarrow as pa

    for path in files:
        schema = _schema_of(path, storage_options)
        if text_column not in schema.names:
            raise ValueError(
                f"{path} has no text column {text_column!r} (its columns: {schema.names}). "
                "Pass text_column=<the column holding each document's text>."
            )
        kind = schema.field(text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise TypeError(
                f"{path}: column {text_column!r} is {kind}, not text (string). Name the text column "
                "(text_column=...), or convert it to strings first."
            )
        if id_column is not None and (
            id_column not in schema.names or not pa.types.is_integer(schema.field(id_column).type)
        ):
            raise TypeError(f"{path}: id_column {id_column!r} must be an integer column of the input.")


def tokenize_file(  # noqa: PLR0913 (one input, one output, then the job's options)
    path: str,
    output: str,
    *,
    number: int,
    source: str,
    tokenizer: str,
    text_column: str = "text",
    id_column: Optional[str] = None,
    group_tokens: int = GROUP_TOKENS,
    max_tokens: Optional[int] = None,
    eos: Optional[str] = None,
    layout: str = "flat",
    compression: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Tokenize input file ``path`` (file ``number`` of its source) into shard ``output``; returns its
    counts. Local or URLs: a local shard is written to a temporary name in its folder and renamed; a
    shard on an object store is written locally, then uploaded whole (one PUT, or a multipart upload:
    the object exists only once complete either way)."""
    import pyarrow.parquet as pq

    tok = load_tokenizer(tokenizer)
    eos_id = None if eos is None else tok.token_id(eos)
    if eos is not None and eos_id is None:
        raise ValueError(f"eos={eos!r} is not a token of {tokenizer}: give a token of its vocabulary.")
    meta = {
        _META["vocab"]: str(tok.vocab_size).encode(),
        _META["tokenizer"]: tok.fingerprint.encode(),
        _META["input"]: (os.path.abspath(path) if _local(path) else path).encode(),
        LAYOUT_KEY: layout.encode(),
    }
    check_layout(layout)
    if layout == "flat":
        schema, options = flat_schema(), flat_writer_options(compression)
    else:
        schema, options = _shard_schema(), {"compression": compression or "snappy"}
    counts = {"documents": 0, "tokens": 0, "empty": 0, "truncated": 0}
    columns = [text_column] + ([id_column] if id_column else [])
    with (
        _shard_file(output, storage_options) as tmp,
        pq.ParquetWriter(tmp, schema.with_metadata(meta), **options) as writer,
    ):
        groups = _RowGroups(writer, source, group_tokens, flat=layout == "flat")
        row = 0
        for batch in _batches(path, columns, storage_options):
            texts = batch.column(0).to_pylist()
            given = batch.column(1).to_pylist() if id_column else None
            for i, values in enumerate(_encode(tok, texts, eos_id, max_tokens, counts)):
                if values is None:
                    continue
                groups.add(values, int(given[i]) if given is not None else number * 2**32 + row + i)
                counts["documents"] += 1
                counts["tokens"] += len(values)
            row += len(texts)
            groups.write_full()
        groups.finish()
    return {"input": path, "output": output, **counts}


def _shard_schema() -> Any:
    """A token shard's columns (the module docstring has what each holds)."""
    import pyarrow as pa

    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("num_tokens", pa.int32()),
            ("document_id", pa.int64()),
            ("source", pa.string()),
        ]
    )


def _encode(
    tok: Any, texts: List[Any], eos_id: Optional[int], max_tokens: Optional[int], counts: Dict[str, int]
) -> List[Optional[np.ndarray]]:
    """Each text's token ids (``eos`` appended, cut to ``max_tokens``: counted as ``truncated``), or None for a
    text that encodes to no tokens (counted as ``empty``)."""
    out: List[Optional[np.ndarray]] = []
    for enc in tok.encode_batch([t or "" for t in texts]):
        values = np.asarray(enc, dtype=np.int32)
        if eos_id is not None and len(values):
            values = np.append(values, np.int32(eos_id))
        if max_tokens is not None and len(values) > max_tokens:
            values, counts["truncated"] = values[:max_tokens], counts["truncated"] + 1
        if not len(values):
            counts["empty"] += 1
            out.append(None)
            continue
        out.append(values)
    return out


class _RowGroups:
    """A shard's documents, buffered and written as row groups of about ``group_tokens`` tokens (its seek unit)."""

    def __init__(self, writer: Any, source: str, group_tokens: int, *, flat: bool) -> None:
        self.writer, self.source, self.group_tokens, self.flat = writer, source, group_tokens, flat
        self.arrays: List[np.ndarray] = []  # documents not written yet, and their ids
        self.ids: List[int] = []

    def add(self, values: np.ndarray, document_id: int) -> None:
        self.arrays.append(values)
        self.ids.append(document_id)

    def write_full(self) -> None:
        """Write the whole row groups buffered: each ends with the document that takes it to ``group_tokens``."""
        ends = np.cumsum([len(a) for a in self.arrays])
        while len(ends) and ends[-1] >= self.group_tokens:
            n = int(np.searchsorted(ends, self.group_tokens)) + 1
            self._write(n)
            ends = ends[n:] - ends[n - 1]

    def finish(self) -> None:
        """Write the documents left, as the last row group."""
        if self.arrays:
            self._write(len(self.arrays))

    def _write(self, n: int) -> None:  # the first n documents, as one row group
        import pyarrow as pa

        arrays, ids = self.arrays, self.ids
        lengths = np.array([len(a) for a in arrays[:n]], dtype=np.int32)
        flat = np.concatenate(arrays[:n]).astype(np.int32) if n else np.zeros(0, np.int32)
        if self.flat:  # one chunk: the documents' tokens end to end, their lengths and ids
            self.writer.write_table(flat_table(flat, lengths, np.array(ids[:n], np.int64), self.source))
            del arrays[:n], ids[:n]
            return
        values = pa.array(flat)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        table = {
            "input_ids": pa.ListArray.from_arrays(offsets, values),
            "num_tokens": pa.array(lengths),
            "document_id": pa.array(ids[:n], pa.int64()),
            "source": pa.array([self.source] * n, pa.string()),
        }
        self.writer.write_table(pa.table(table, schema=_shard_schema()))
        del arrays[:n], ids[:n]


@contextlib.contextmanager
def _shard_file(output: str, storage_options: Optional[Dict[str, Any]]) -> Iterator[str]:
    """A local file to write shard ``output`` to, which becomes ``output`` once the block ends without an error:
    renamed in its folder (local), or uploaded whole from a scratch folder (an object store)."""
    with contextlib.ExitStack() as scratch:
        if _local(output):
            os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
            tmp = f"{output}.tmp-{os.getpid()}"
        else:
            tmp = os.path.join(scratch.enter_context(tempfile.TemporaryDirectory(prefix="tokenize-")), "part.parquet")
        yield tmp
        if _local(output):
            os.replace(tmp, output)  # the shard exists only once complete
        else:
            fs, at = _fs(output, storage_options)
            fs.put_file(tmp, at)  # an object appears only once its upload completes


def _done(
    output: str, path: str, tokenizer_sha: str, layout: str, storage_options: Optional[Dict[str, Any]] = None
) -> bool:
    """Whether shard ``output`` is this input's with this tokenizer and layout (refusing one that is another's)."""
    import pyarrow.parquet as pq

    fs, at = _fs(output, storage_options)
    if not fs.exists(at):
        return False
    with fs.open(at, "rb") as handle:
        meta = pq.read_schema(handle).metadata or {}
    made_from, made_with = meta.get(_META["input"], b"").decode(), meta.get(_META["tokenizer"], b"").decode()
    if made_from != path or made_with != tokenizer_sha:
        raise FileExistsError(
            f"{output} already holds tokens of {made_from or 'another job'} (tokenizer {made_with[:12] or '?'}), not of "
            f"{path} with this tokenizer ({tokenizer_sha[:12]}). Fix: another output folder, or delete it to redo."
        )
    written = meta.get(LAYOUT_KEY, b"documents").decode()
    if written != layout:
        raise FileExistsError(
            f"{output} holds these tokens in the {written!r} layout, not layout={layout!r}: a source's shards "
            f"share one layout. Fix: layout={written!r}, another output folder, or delete it to redo."
        )
    return True


def tokenize(  # noqa: PLR0913 (inputs and output, then keyword-only options, each documented)
    inputs: Union[str, Sequence[str], Mapping[str, Union[str, Sequence[str]]]],
    output: str,
    *,
    tokenizer: str,
    text_column: str = "text",
    id_column: Optional[str] = None,
    group_tokens: int = GROUP_TOKENS,
    max_tokens: Optional[int] = None,
    eos: Optional[str] = None,
    num_cpus: float = 1,
    vocab_size: Optional[int] = None,
    layout: str = "flat",
    compression: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Tokenize ``inputs`` (paths, or ``{source: paths}``; a bare path is source ``"train"``) into
    ``output/<source>/`` on Ray Data (see module doc). Returns per-source counts and the shards
    written and skipped; the token folders are then ``PackedTokens("output/<source>", ...)``.
    ``vocab_size``: the model's embedding rows, to refuse a tokenizer with more ids before any task.
    ``layout``: ``"flat"`` or ``"documents"`` (module doc); ``compression``: the shards' Parquet codec (default:
    none for flat, whose reads it would slow several times, `token_files.py`; snappy for documents)."""
    import ray

    check_layout(layout)
    check_compression(compression)
    sources = {"train": inputs} if isinstance(inputs, (str, list, tuple)) else dict(inputs)
    sha = _checked_tokenizer(tokenizer, vocab_size, eos).fingerprint
    options = {
        "tokenizer": os.path.abspath(tokenizer) if os.path.exists(tokenizer) else tokenizer,
        "text_column": text_column,
        "id_column": id_column,
        "group_tokens": group_tokens,
        "max_tokens": max_tokens,
        "eos": eos,
        "layout": layout,
        "compression": compression,
        "storage_options": storage_options,
    }
    todo, skipped = _shards_to_write(sources, output, sha, text_column, id_column, layout, storage_options)
    results: List[Dict[str, Any]] = []
    if todo:

        def run(item: Dict[str, Any]) -> Dict[str, Any]:
            return {
                **tokenize_file(item["path"], item["output"], number=item["number"], source=item["source"], **options),
                "source": item["source"],
            }

        dataset = ray.data.from_items(todo, override_num_blocks=len(todo))
        results = dataset.map(run, num_cpus=num_cpus).take_all()
    return _summary(list(sources), results, skipped)


def _checked_tokenizer(tokenizer: str, vocab_size: Optional[int], eos: Optional[str]) -> Any:
    """The tokenizer, loaded before any task; refused when it has more ids than the model's embedding
    (``vocab_size``) or lacks the ``eos`` token."""
    tok = load_tokenizer(tokenizer)  # a missing or unreadable tokenizer fails here, before any task
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(
            f"The tokenizer {tokenizer!r} has {tok.vocab_size} token ids, more than vocab_size={vocab_size} (the "
            f"model's embedding). Fix: a model with vocab_size >= {tok.vocab_size}, or the model's own tokenizer."
        )
    if eos is not None and tok.token_id(eos) is None:
        raise ValueError(f"eos={eos!r} is not a token of {tokenizer}: give a token of its vocabulary.")
    return tok


def _shards_to_write(  # noqa: PLR0913 (the job's sources and output, the tokenizer's fingerprint, its columns, layout)
    sources: Mapping[str, Union[str, Sequence[str]]],
    output: str,
    tokenizer_sha: str,
    text_column: str,
    id_column: Optional[str],
    layout: str,
    storage_options: Optional[Dict[str, Any]],
) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """Each source's input files checked for their columns, and the shards to write: ``([{path, output, number,
    source}], {source: shards skipped})``; a shard already written from the same input with the same tokenizer
    is skipped (a rerun resumes)."""
    todo: List[Dict[str, Any]] = []
    skipped: Dict[str, int] = {}
    for name, paths in sources.items():
        files = _inputs(paths, storage_options)
        check_text_columns(files, text_column, id_column, storage_options)
        for number, path in enumerate(files):
            out = _join(output, name, f"part-{number:05d}.parquet")
            if _done(out, path, tokenizer_sha, layout, storage_options):
                skipped[name] = skipped.get(name, 0) + 1
            else:
                todo.append({"path": path, "output": out, "number": number, "source": name})
    return todo, skipped


def _summary(sources: List[str], results: List[Dict[str, Any]], skipped: Dict[str, int]) -> Dict[str, Any]:
    """Shards written and skipped, and per source the documents, tokens, empty and truncated documents."""
    summary: Dict[str, Any] = {"written": len(results), "skipped": sum(skipped.values()), "sources": {}}
    for name in sources:
        mine = [r for r in results if r["source"] == name]
        summary["sources"][name] = {k: sum(r[k] for r in mine) for k in ("documents", "tokens", "empty", "truncated")}
        summary["sources"][name]["skipped_shards"] = skipped.get(name, 0)
    return summary
