"""Tokenize text once on the cluster: text Parquet/JSONL into seekable token Parquet (`tokenize`).

``tokenize({"web": "text/web/", "code": "text/code/*.jsonl"}, "tokens/", tokenizer="bpe.json")``
(or ``raytrain-events tokenize``) writes, per source, one token Parquet shard per input file:
``tokens/<source>/part-<NNNNN>.parquet`` with columns ``input_ids`` (a list of int32 per document),
``num_tokens`` (int32), ``document_id`` (int64: the input's id column when named, else
``file number * 2**32 + row``, stable across reruns) and ``source``. Each shard's footer records
the tokenizer's vocabulary size (`packed_source.VOCAB_KEY`, checked against the model by
`PackedTokens(vocab_size=...)` before training), the tokenizer file's SHA-256 and its input file.
Row groups hold about ``group_tokens`` tokens (default 1 Mi, 4 MiB of ids): the seek unit of
`ParquetRowGroups`/`PackedTokens` (a resume reads at most one row group before its position) and a
fraction of the seekable path's 16 MiB reads.

The job runs on Ray Data: the input files not yet done become a dataset of file names, ``map``-ed
by tasks (``num_cpus`` each) that each read one input file in batches, encode them with Hugging
Face ``tokenizers`` (a ``tokenizer.json`` on disk, loaded once per task; its Rust encoder batches
the texts) and write the shard through a temporary name renamed on success. Resumable: a shard
exists only once complete, so a rerun after a failure does the files whose shards are missing.
Idempotent: a rerun over the same inputs with the same tokenizer writes nothing (each existing
shard's footer names its input and tokenizer; a shard made from another input or tokenizer is
refused, naming the fix, never silently mixed). Per-file tasks rather than
``Dataset.write_parquet`` (whose file names are fresh on every run, so a rerun could neither skip
finished work nor avoid duplicates); the unit of parallelism is the input file.

Documents: text that encodes to no tokens (empty, or nothing the tokenizer keeps) is skipped and
counted (``empty``); ``max_tokens`` cuts longer documents to that many tokens, counted
(``truncated``); ``eos`` appends that token to each document. A text column that is not text
(string) is refused before any task runs, as is a missing tokenizer file or column.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np

__all__ = ["tokenize", "tokenize_file", "GROUP_TOKENS"]

GROUP_TOKENS = 1 << 20  # tokens per row group of the output
_BATCH_ROWS = 1024  # documents encoded at once
_META = {
    "vocab": b"raytrain_events.vocab_size",
    "tokenizer": b"raytrain_events.tokenizer_sha256",
    "input": b"raytrain_events.input",
}


def _inputs(paths: Union[str, Sequence[str]]) -> List[str]:
    """Input files: each path a file, a folder (its .parquet/.jsonl/.json files, sorted) or a glob."""
    import glob

    out: List[str] = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        if os.path.isdir(path):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(path)
                for name in names
                if name.endswith((".parquet", ".jsonl", ".json")) and not name.startswith((".", "_"))
            )
        else:
            found = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path] if os.path.isfile(path) else []
        if not found:
            raise FileNotFoundError(
                f"tokenize found no .parquet/.jsonl input at {path!r}: give files, folders or globs."
            )
        out += found
    return out


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_tokenizer(path: str) -> Any:
    """A Hugging Face ``tokenizers.Tokenizer`` from a ``tokenizer.json`` on disk (no network)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The tokenizer file {path!r} does not exist. Give the path of a tokenizer.json (tokenizers' "
            "Tokenizer.save, or a Hugging Face model folder's tokenizer.json); nothing is downloaded."
        )
    from tokenizers import Tokenizer  # deferred: an optional dependency (pip install raytrain_events[text])

    return Tokenizer.from_file(path)


def _batches(path: str, columns: List[str]) -> Iterator[Any]:
    """Record batches of ``columns`` of one input file (Parquet, or JSON lines)."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        yield from pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS, columns=columns)
        return
    yield from pj.read_json(path).select(columns).to_batches(max_chunksize=_BATCH_ROWS)


def _schema_of(path: str) -> Any:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        return pq.read_schema(path)
    return pj.read_json(path).schema


def check_text_columns(files: Sequence[str], text_column: str, id_column: Optional[str]) -> None:
    """Refuse an input without the text column, or whose text column is not text, before any task runs."""
    import pyarrow as pa

    for path in files:
        schema = _schema_of(path)
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
) -> Dict[str, Any]:
    """Tokenize input file ``path`` (file ``number`` of its source) into shard ``output``; returns its counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = load_tokenizer(tokenizer)
    eos_id = None if eos is None else tok.token_to_id(eos)
    if eos is not None and eos_id is None:
        raise ValueError(f"eos={eos!r} is not a token of {tokenizer}.")
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("num_tokens", pa.int32()),
            ("document_id", pa.int64()),
            ("source", pa.string()),
        ]
    )
    meta = {
        _META["vocab"]: str(tok.get_vocab_size()).encode(),
        _META["tokenizer"]: _sha256(tokenizer).encode(),
        _META["input"]: os.path.abspath(path).encode(),
    }
    counts = {"documents": 0, "tokens": 0, "empty": 0, "truncated": 0}
    arrays: List[np.ndarray] = []  # documents not written yet, and their ids
    ids: List[int] = []
    tmp = f"{output}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    row = 0
    with pq.ParquetWriter(tmp, schema.with_metadata(meta)) as writer:

        def write(n: int) -> None:  # the first n documents, as one row group
            lengths = np.array([len(a) for a in arrays[:n]], dtype=np.int32)
            values = pa.array(np.concatenate(arrays[:n]).astype(np.int32) if n else np.zeros(0, np.int32))
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            table = {
                "input_ids": pa.ListArray.from_arrays(offsets, values),
                "num_tokens": pa.array(lengths),
                "document_id": pa.array(ids[:n], pa.int64()),
                "source": pa.array([source] * n, pa.string()),
            }
            writer.write_table(pa.table(table, schema=schema))
            del arrays[:n], ids[:n]

        columns = [text_column] + ([id_column] if id_column else [])
        for batch in _batches(path, columns):
            texts = batch.column(0).to_pylist()
            given = batch.column(1).to_pylist() if id_column else None
            encoded = tok.encode_batch([t or "" for t in texts], add_special_tokens=False)
            for i, enc in enumerate(encoded):
                values = np.asarray(enc.ids, dtype=np.int32)
                if eos_id is not None and len(values):
                    values = np.append(values, np.int32(eos_id))
                if max_tokens is not None and len(values) > max_tokens:
                    values, counts["truncated"] = values[:max_tokens], counts["truncated"] + 1
                if not len(values):
                    counts["empty"] += 1
                    continue
                arrays.append(values)
                ids.append(int(given[i]) if given is not None else number * 2**32 + row + i)
                counts["documents"] += 1
                counts["tokens"] += len(values)
            row += len(texts)
            ends = np.cumsum([len(a) for a in arrays])
            while len(ends) and ends[-1] >= group_tokens:  # whole row groups of about group_tokens tokens
                n = int(np.searchsorted(ends, group_tokens)) + 1
                write(n)
                ends = ends[n:] - ends[n - 1]
        if arrays:
            write(len(arrays))
    os.replace(tmp, output)  # the shard exists only once complete
    return {"input": path, "output": output, **counts}


def _done(output: str, path: str, tokenizer_sha: str) -> bool:
    """Whether shard ``output`` is this input's with this tokenizer (refusing one that is another's)."""
    import pyarrow.parquet as pq

    if not os.path.exists(output):
        return False
    meta = pq.read_schema(output).metadata or {}
    made_from, made_with = meta.get(_META["input"], b"").decode(), meta.get(_META["tokenizer"], b"").decode()
    if made_from != os.path.abspath(path) or made_with != tokenizer_sha:
        raise FileExistsError(
            f"{output} already holds tokens of {made_from or 'another job'} (tokenizer {made_with[:12] or '?'}), not of "
            f"{path} with this tokenizer ({tokenizer_sha[:12]}). Fix: another output folder, or delete it to redo."
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
) -> Dict[str, Any]:
    """Tokenize ``inputs`` (paths, or ``{source: paths}``; a bare path is source ``"train"``) into
    ``output/<source>/`` on Ray Data (see module doc). Returns per-source counts and the shards
    written and skipped; the token folders are then ``PackedTokens("output/<source>", ...)``."""
    import ray

    sources = {"train": inputs} if isinstance(inputs, (str, list, tuple)) else dict(inputs)
    load_tokenizer(tokenizer)  # a missing or unreadable tokenizer fails here, before any task
    sha = _sha256(tokenizer)
    options = {
        "tokenizer": os.path.abspath(tokenizer),
        "text_column": text_column,
        "id_column": id_column,
        "group_tokens": group_tokens,
        "max_tokens": max_tokens,
        "eos": eos,
    }
    todo: List[Dict[str, Any]] = []
    skipped: Dict[str, int] = {}
    for name, paths in sources.items():
        files = _inputs(paths)
        check_text_columns(files, text_column, id_column)
        for number, path in enumerate(files):
            out = os.path.join(output, name, f"part-{number:05d}.parquet")
            if _done(out, path, sha):
                skipped[name] = skipped.get(name, 0) + 1
            else:
                todo.append({"path": path, "output": out, "number": number, "source": name})
    results: List[Dict[str, Any]] = []
    if todo:

        def run(item: Dict[str, Any]) -> Dict[str, Any]:
            return {
                **tokenize_file(item["path"], item["output"], number=item["number"], source=item["source"], **options),
                "source": item["source"],
            }

        dataset = ray.data.from_items(todo, override_num_blocks=len(todo))
        results = dataset.map(run, num_cpus=num_cpus).take_all()
    summary: Dict[str, Any] = {"written": len(results), "skipped": sum(skipped.values()), "sources": {}}
    for name in sources:
        mine = [r for r in results if r["source"] == name]
        summary["sources"][name] = {k: sum(r[k] for r in mine) for k in ("documents", "tokens", "empty", "truncated")}
        summary["sources"][name]["skipped_shards"] = skipped.get(name, 0)
    return summary
