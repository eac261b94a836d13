"""`PackedTokens`: token documents in Parquet packed into ``seq_len`` sequences, as a seekable train source.

``RayTrainer(datasets={"train": PackedTokens("tokens/", seq_len=2048, policy="best_fit")}, ...)``:
each row of the train order is one packed sequence (``input_ids``, ``document_ids``,
``position_ids``: ``(seq_len,)`` each; ``num_tokens``: its real tokens), so the feeder, the loaders,
resumes, resizes, feeder restarts and mixtures treat it as any seekable source
(`parquet_seek.ParquetRowGroups`): the order is a function of (seed, epoch) only, the same at any
world size, and a resume at sequence ``p`` opens the one pack window holding ``p`` and nothing
before it.

Pack windows: the source's row groups, in file order, grouped into consecutive runs of at least
``window_tokens`` tokens (default ``256 * seq_len``); each window is packed on its own
(`raytrain_events.core.packing`), so nothing carries over between windows and a window's
sequences are re-made exactly wherever it is packed. With a seed the *windows* are permuted per
epoch (the row groups inside one stay in file order, so a window's sequences never change), and
``shuffle_buffer_size`` permutes sequences across windows as for any source.

Packed offline (`pack_tokens`, ``raytrain-events pack``): over a folder of the ``packed`` layout
(`packed_files.py`) the windows are its row groups, already packed for one ``seq_len``, policy,
``window_tokens`` and ``pad_id`` (another is refused), everything the driver needs is in the footers,
and a read task makes the same blocks from views of the bytes it read: no placement, no gather.

Built on the driver, before Ray starts: the footers (row counts, each file's layout,
`token_files.py`: one per source, and the token ids' min/max statistics: ids outside
``[0, vocab_size)`` are refused here, before any training, when the writer kept statistics; a
second footer read per file where there are several files or a ``vocab_size``) and each document's
length (a flat file's ``lengths`` bytes, or the documents layout's ``num_tokens`` column, 4 bytes
per document; else the token column's list lengths, which reads the tokens once). The read tasks
read a flat file's chunks as NumPy views of their bytes (no Parquet list decoding: about a fifth of
the documents layout's read CPU, `bench/packing.py --parts cpu`). From the lengths each window's sequence count is known
(under ``best_fit`` a document longer than ``seq_len`` is refused here), and only those counts are
kept: one integer per window. Cost at scale: that build is O(documents) once per source (threads,
one read per row group); the feeder holds the per-window counts (8 bytes each) and, as for any
source, the blocks between the slowest rank and its pull front: with 512 ranks a global batch of
``512 * b`` sequences spans ``512 * b / (window sequences)`` windows, one block each. Packing runs
in the read tasks (``packed_reads.py``; one Ray task packs consecutive windows up to about 16 MiB of compact blocks,
`block_bytes`, as `ParquetRowGroups` sizes its reads, 64 MiB ahead of the feeder; O(tokens) array work
plus O(d log d) for best_fit), never on the feeder or a rank; a rank's part of a batch is one or two
slices of window blocks, cut where the blocks are. A block holds the tokens and each sequence's
documents as runs (`pack_reads`: 4 + 12 / (mean document tokens) bytes per int32 token into the
object store and across nodes, 4.35 for documents of 34 tokens, not the batch's 16); the rank turns
its rows into segments (`packed_batch.packed_tensors`, called by the loader on every batch: O(runs +
sequences) numbers, nothing per token), and the loop makes ``document_ids``/``position_ids`` from them on
the device, after moving the batch (the loader's ``device_transforms``, `packed_batch.expand_batch`).

Document ids are the ``document_id`` column when the files have one (`tokenize` writes it), else
the document's row number in the source (files in order, row groups in order): the same in every
epoch, so a test can check that every document's tokens train once per epoch. Empty documents take
no room (they are skipped).

Mixtures: sources are packed separately (each source a `PackedTokens`, a sequence holds documents of
one source): the mixture's plan chooses sequences, so each sequence's real tokens count toward
exactly one source (``mixture/tokens/<source>`` with `count_real_tokens`), and each source's count is
its own windows' (known on the driver); packed together, the plan would have to choose documents,
and a sequence's count would be known only by packing the mixed stream from the epoch's start.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from raytrain_events.core.packing import check_policy, sequences_in_window
from raytrain_events.data.ray.packed_batch import DOCUMENT_FORMATS
from raytrain_events.data.ray.packed_files import packed_state
from raytrain_events.data.ray.packed_reads import pack_reads
from raytrain_events.data.ray.parquet_seek import (
    AHEAD_BYTES,
    READ_BYTES,
    ParquetRowGroups,
    is_seekable,
    stream_entry,
)
from raytrain_events.data.ray.token_files import (
    FLAT_COLUMNS,
    TOKEN_DTYPE,
    VOCAB_KEY,
    check_vocabulary,
    flat_values,
    layout_of,
)

__all__ = ["PackedTokens", "count_real_tokens", "VOCAB_KEY"]


def block_bytes(sequences: int, documents: int, seq_len: int, token_bytes: int) -> int:
    """Bytes of a compact packed block (`pack_reads`) of ``sequences`` packed from ``documents``
    non-empty documents, at most: the tokens, per sequence ``num_tokens`` and the two run lists'
    offsets (int32 each), per run its document (int64) and length (int32), with at most ``documents
    + sequences`` runs (a sequence end cuts at most one document). About ``token_bytes`` per token and
    a little (4.3 bytes per int32 token for documents of ~100 tokens), where the expanded batch is 16."""
    return sequences * (seq_len * token_bytes + 12) + (documents + sequences) * 12


def count_real_tokens(batch: Any) -> int:
    """Real (non-padding) tokens of a packed batch: ``RayTrainer(get_num_tokens_in_batch=count_real_tokens)``."""
    return int(batch["num_tokens"].sum())


def _token_type(schema: Any, tokens_column: str) -> Any:
    """The integer type of ``tokens_column``'s token ids (a list of them per document), or a clear error."""
    import pyarrow as pa

    if tokens_column not in schema.names:
        raise ValueError(
            f"PackedTokens: the Parquet files have no {tokens_column!r} column (they have "
            f"{schema.names}). Pass tokens_column=<the column of token ids>."
        )
    kind = schema.field(tokens_column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise TypeError(
            f"PackedTokens: column {tokens_column!r} is {kind}, not a list of integer token ids per "
            "document. Tokenize the text first (raytrain-events tokenize) or name the token column."
        )
    return kind.value_type


def _packed_schema(value_type: Any, seq_len: int, document_format: str = "document_ids") -> Any:
    """The packed sequences' Arrow schema: ``seq_len`` token ids (the source's integer type), their document ids and
    positions (or, as ``cu_seqlens``, each sequence's segment lengths: a batch's ``cu_seqlens`` is their cumulative
    sum over its rows), and the real token count of each sequence."""
    import pyarrow as pa

    tokens = pa.field("input_ids", pa.list_(pa.from_numpy_dtype(_token_dtype(value_type)), seq_len))
    if document_format == "cu_seqlens":
        return pa.schema([tokens, pa.field("cu_seqlens", pa.list_(pa.int32())), pa.field("num_tokens", pa.int32())])
    return pa.schema(
        [
            tokens,
            pa.field("document_ids", pa.list_(pa.int64(), seq_len)),
            pa.field("position_ids", pa.list_(pa.int32(), seq_len)),
            pa.field("num_tokens", pa.int32()),
        ]
    )


class PackedTokens:
    """Token documents packed into sequences (see module doc).

    ``source``: a `ParquetRowGroups`, or what it takes (a file, folder, glob, URI or a list).
    ``seq_len``: tokens per sequence; ``policy``: ``"concat"`` or ``"best_fit"`` (`core.packing`).
    ``tokens_column``: a list of integer token ids per document; ``length_column`` /
    ``id_column``: read when the files have them. ``vocab_size``: refuse ids outside
    ``[0, vocab_size)`` (the model's embedding size). ``pad_id``: the token of padding.
    ``document_format``: what a batch carries of the documents (`packed_batch.DOCUMENT_FORMATS`):
    ``"document_ids"`` (per token ``document_ids``/``position_ids``) or ``"cu_seqlens"`` (the
    batch's segment boundaries, ``cu_seqlens`` and ``max_seqlen``: nothing per token on the rank).
    """

    def __init__(  # noqa: PLR0913 (the source, then keyword-only options, each documented)
        self,
        source: Any,
        *,
        seq_len: int,
        policy: str = "concat",
        tokens_column: str = "input_ids",
        length_column: str = "num_tokens",
        id_column: str = "document_id",
        window_tokens: Optional[int] = None,
        vocab_size: Optional[int] = None,
        pad_id: int = 0,
        document_format: str = "document_ids",
    ) -> None:
        check_policy(policy, seq_len)
        if document_format not in DOCUMENT_FORMATS:
            raise ValueError(f"PackedTokens: document_format={document_format!r}; give one of {DOCUMENT_FORMATS}.")
        self.document_format = document_format
        if is_seekable(source) and not isinstance(source, ParquetRowGroups):
            raise TypeError(
                f"PackedTokens packs Parquet token documents; got a {type(source).__name__}. Pass the "
                "token Parquet's paths or a ParquetRowGroups over them."
            )
        parquet = source if isinstance(source, ParquetRowGroups) else ParquetRowGroups(source)
        self.seq_len, self.policy, self.pad_id = seq_len, policy, pad_id
        self.window_tokens = window_tokens or 256 * seq_len
        self.paths, self.filesystem = parquet.paths, parquet.filesystem
        schema = parquet.schema
        self.layout = layout_of(schema)  # each file's layout is checked against the first's (`_check_footers`)
        if self.layout == "packed":  # sequences packed offline: everything from the footers (`packed_files.py`)
            self._from_packed(parquet, window_tokens, vocab_size)
            return
        value_type = _token_type(schema, tokens_column) if self.layout == "documents" else pa.int32()
        self.tokens_column = tokens_column
        self.length_column = length_column if length_column in schema.names else None
        self.id_column = id_column if id_column in schema.names else None
        self.vocab_size = vocab_size
        self._check_footers(vocab_size)
        self.units = [(f, g) for f, g, _ in parquet.units]
        lengths = self._lengths()
        bases = np.cumsum([0] + [len(x) for x in lengths])
        self.bases = [int(b) for b in bases[:-1]]  # each unit's first document row (file order)
        self._cut_windows(lengths, token_bytes=np.dtype(_token_dtype(value_type)).itemsize)
        self.documents = int(bases[-1])
        self.real_tokens = int(sum(int(x.sum()) for x in lengths))
        self.schema = _packed_schema(value_type, seq_len, document_format)
        if not self.window_sequences:
            raise ValueError(f"PackedTokens: the documents of {self.paths[:3]} hold no tokens.")

    def _from_packed(self, parquet: ParquetRowGroups, window_tokens: Optional[int], vocab_size: Optional[int]) -> None:
        """The source over files packed offline (`pack_tokens`): each row group one window, all from the footers."""
        state = packed_state(
            self.paths,
            self.filesystem,
            self.seq_len,
            self.policy,
            window_tokens,
            self.pad_id,
            vocab_size,
        )
        self.window_tokens, self.vocab_size = state["window_tokens"], vocab_size
        self.tokens_column, self.length_column, self.id_column = "tokens", None, None
        self.units = [(f, g) for f, g, _ in parquet.units]
        self.bases = [0] * len(self.units)  # the document ids are in the files
        self.windows = [(u, u + 1) for u in range(len(self.units))]
        self.window_sequences = state["sequences"]
        self.window_bytes = [
            block_bytes(n, r - n, self.seq_len, 4) for n, r in zip(state["sequences"], state["pieces"])
        ]
        self.documents, self.real_tokens = sum(state["documents"]), sum(state["real_tokens"])
        self.schema = _packed_schema(pa.int32(), self.seq_len, self.document_format)

    def _cut_windows(self, lengths: List[np.ndarray], *, token_bytes: int) -> None:
        """Cut the units (row groups, in file order) into windows of about `window_tokens` tokens each, packed
        apart: each window's first and end unit, its sequence count and its compact block's bytes. A window
        whose documents pack into no sequence is left out."""
        self.windows: List[Tuple[int, int]] = []  # (first unit, end unit) of each window
        self.window_sequences: List[int] = []
        self.window_bytes: List[int] = []  # each window's compact block, at most (`block_bytes`): sizes reads
        start, tokens = 0, 0
        for u, unit_lengths in enumerate(lengths):
            tokens += int(unit_lengths.sum())
            if tokens >= self.window_tokens or u == len(lengths) - 1:
                where = f"{self.paths[self.units[start][0]]} (row groups of window {len(self.windows)})"
                window_lengths = np.concatenate(lengths[start : u + 1])
                count = sequences_in_window(window_lengths, self.seq_len, self.policy, where)
                if count:
                    self.windows.append((start, u + 1))
                    self.window_sequences.append(count)
                    documents = int(np.count_nonzero(window_lengths))
                    self.window_bytes.append(block_bytes(count, documents, self.seq_len, token_bytes))
                start, tokens = u + 1, 0

    def _read(self, f: int, g: int, columns: List[str]) -> Any:
        import pyarrow.parquet as pq

        path = self.paths[f]
        if self.filesystem is None:
            return pq.ParquetFile(path).read_row_group(g, columns=columns)
        with self.filesystem.open_input_file(path) as handle:
            return pq.ParquetFile(handle).read_row_group(g, columns=columns)

    def _lengths(self) -> List[np.ndarray]:
        """Each unit's document lengths, in order (threads: one read per row group)."""
        column = self.length_column or self.tokens_column

        def one(unit: Tuple[int, int]) -> np.ndarray:
            if self.layout == "flat":  # the lengths' bytes (4 per document), not the tokens
                return np.concatenate(
                    flat_values(self._read(unit[0], unit[1], ["lengths"]).column("lengths"), TOKEN_DTYPE, "lengths")
                    or [np.zeros(0, TOKEN_DTYPE)]
                ).astype(np.int64)
            values = self._read(unit[0], unit[1], [column]).column(column)
            return _list_lengths(values) if self.length_column is None else values.to_numpy().astype(np.int64)

        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(one, self.units))

    def _check_footers(self, vocab_size: Optional[int]) -> None:
        """Every file's layout the first file's (one read path per source); with ``vocab_size``, refuse from the
        footers only a tokenizer vocabulary or token ids the model's embedding cannot take."""
        import pyarrow.parquet as pq

        def meta_of(path: str) -> Any:
            if self.filesystem is None:
                return pq.ParquetFile(path).metadata
            with self.filesystem.open_input_file(path) as handle:
                return pq.ParquetFile(handle).metadata

        if len(self.paths) == 1 and vocab_size is None:
            return
        with ThreadPoolExecutor(16) as pool:
            metas = list(pool.map(meta_of, self.paths))
        for path, meta in zip(self.paths, metas):
            layout = layout_of(meta.schema.to_arrow_schema())
            if layout != self.layout:
                raise ValueError(
                    f"{path} is a {layout!r} token file, {self.paths[0]} a {self.layout!r} one: one PackedTokens "
                    "reads one layout. Fix: tokenize the source again into one folder with one layout=."
                )
            if vocab_size is not None:
                check_vocabulary(path, meta, vocab_size, self.tokens_column if layout == "documents" else None)

    def count(self) -> int:
        """Packed sequences in an epoch (fixed on the driver: the windows' counts)."""
        return sum(self.window_sequences)

    def order(self, seed: Optional[int], epoch: int) -> List[int]:
        """The epoch's windows in order: file order, or permuted by ``(seed, epoch)``."""
        if seed is None:
            return list(range(len(self.windows)))
        return [int(i) for i in np.random.default_rng([seed, epoch, 2]).permutation(len(self.windows))]

    def stream(
        self, seed: Optional[int], epoch: int, row: int, window_rows: int = 0, global_batch: Optional[int] = None
    ) -> Tuple[Iterator[Any], int, int]:
        """``(bundles from the window holding sequence ``row``, that window's first sequence, shuffle
        windows before it)``; with ``window_rows``, from the shuffle window holding it (as `ParquetRowGroups`)."""
        del global_batch  # the order does not depend on the batch

        order = self.order(seed, epoch)
        start, first, windows = stream_entry([self.window_sequences[w] for w in order], row, window_rows)
        return self._bundles(order[start:]), first, windows

    def window_args(self, w: int) -> Dict[str, Any]:
        """What the read task of window ``w`` needs (plain values)."""
        a, b = self.windows[w]
        if self.layout == "packed":  # one row group a window, read as packed (`packed_files.packed_block`)
            return {
                "layout": "packed",
                "paths": self.paths,
                "units": self.units[a:b],
                "filesystem": self.filesystem,
                "seq_len": self.seq_len,
                "expected": self.window_sequences[w],
                "document_format": self.document_format,
                "what": f"pack window {w}",
            }
        columns = [self.tokens_column] + [c for c in (self.id_column,) if c]
        return {
            "layout": self.layout,
            "paths": self.paths,
            "units": self.units[a:b],
            "bases": self.bases[a:b],
            "filesystem": self.filesystem,
            "columns": columns if self.layout == "documents" else FLAT_COLUMNS,
            "tokens_column": self.tokens_column,
            "id_column": self.id_column,
            "seq_len": self.seq_len,
            "policy": self.policy,
            "pad_id": self.pad_id,
            "vocab_size": self.vocab_size,
            "expected": self.window_sequences[w],
            "document_format": self.document_format,
            "what": f"pack window {w}",
        }

    def reads(self, windows: List[int]) -> List[List[int]]:
        """``windows`` (in the epoch's order) grouped into read tasks: consecutive windows until about
        `parquet_seek.READ_BYTES` of packed columns (a pure function of the order, as `ParquetRowGroups.reads`)."""

        out: List[List[int]] = []
        current: List[int] = []
        size = 0
        for w in windows:
            current.append(w)
            size += self.window_bytes[w]
            if size >= READ_BYTES:
                out.append(current)
                current, size = [], 0
        return out + ([current] if current else [])

    def _bundles(self, windows: List[int]) -> Iterator[Any]:
        import ray

        task = ray.remote(pack_reads).options(num_cpus=0.25)
        todo = iter(self.reads(windows))
        pending: List[Tuple[Any, List[int], int]] = []  # (block ref, its windows, bytes)
        in_flight = 0
        while True:
            while not pending or in_flight < AHEAD_BYTES:  # reads ahead of the feeder's pull, as ParquetRowGroups
                group = next(todo, None)
                if group is None:
                    break
                size = sum(self.window_bytes[w] for w in group)
                pending.append((task.remote([self.window_args(w) for w in group]), group, size))
                in_flight += size
            if not pending:
                return
            ref, group, size = pending.pop(0)
            ray.wait([ref], fetch_local=False)  # handed on once packed: the block then has a node to cut on
            in_flight -= size
            offset = 0
            for w in group:  # each window a slice of the read's block
                rows = self.window_sequences[w]
                yield SimpleNamespace(
                    blocks=[(ref, SimpleNamespace(num_rows=rows))],
                    slices=[SimpleNamespace(start_offset=offset, num_rows=rows)],
                )
                offset += rows


def _token_dtype(kind: Any) -> Any:
    return kind.to_pandas_dtype()


def _list_lengths(values: Any) -> np.ndarray:
    """Per row, the list's length (0 for a null list), as int64."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(values), 0).to_numpy().astype(np.int64)
