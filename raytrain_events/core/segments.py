"""A packed batch's sequences as *segments*: O(runs + sequences) numbers, expanded to per-token columns.

`core.packing` packs documents into sequences given as *runs* (a document's piece in one sequence);
`run_segments` lays a batch's runs and each sequence's padding end to end over its rows (``cu_seqlens``
style), and `expand_segments` (NumPy, on the host) or `expand_segments_torch` (on the batch's device:
a few kernels and no host sync on an accelerator) makes ``document_ids`` and ``position_ids`` from them.
The data path ships segments to the device (``raytrain_events.data.ray.packed_batch``), so a rank sends
O(runs + sequences) numbers per batch instead of 12 bytes per token. Pure functions: NumPy here, torch
imported only inside `expand_segments_torch` (the read tasks import this module without torch).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "PAD_DOCUMENT",
    "SEGMENT_COLUMNS",
    "Segments",
    "run_segments",
    "expand_segments",
    "expand_segments_torch",
    "is_segmented",
    "segment_rows",
]

PAD_DOCUMENT = -1  # document id of padding tokens
# A batch's segments (`Segments`' fields) as columns, in place of document_ids/position_ids until expanded.
SEGMENT_COLUMNS = ("segment_documents", "segment_lengths", "segment_starts")


class Segments(NamedTuple):
    """A batch's sequences as *segments* laid end to end over its rows (``cu_seqlens`` style): each run,
    and each sequence's padding (if any) as one more segment after its runs, so the segments tile
    ``rows * seq_len`` tokens. O(runs + sequences) numbers: what a rank ships to the device, where
    `expand_segments_torch` makes the per-token columns (`run_segments` made them on the host)."""

    documents: np.ndarray  # int64 per segment: its document (PAD_DOCUMENT on padding)
    lengths: np.ndarray  # int32 per segment: its tokens (a padding segment may hold none)
    starts: np.ndarray  # int32 per segment: its first token's place in its row; seq_len on padding


def run_segments(
    documents: np.ndarray, lengths: np.ndarray, runs: np.ndarray, num_tokens: np.ndarray, seq_len: int
) -> Segments:
    """The `Segments` of sequences given as runs (`Runs`' fields), checked to tile ``len(runs) x
    seq_len`` (else a ValueError: a corrupt packed block). O(runs + sequences): nothing per token."""
    n = len(runs)
    runs = np.asarray(runs, dtype=np.intp)
    num_tokens = np.asarray(num_tokens, dtype=np.intp)
    lengths = np.asarray(lengths, dtype=np.intp)
    ends = np.cumsum(runs)  # each sequence's end in the runs
    cum = np.zeros(len(lengths) + 1, dtype=np.intp)
    np.cumsum(lengths, out=cum[1:])
    if (
        len(lengths) != int(ends[-1] if n else 0)
        or len(documents) != len(lengths)
        or (len(lengths) and int(lengths.min()) < 0)
        or (n and (int(num_tokens.max()) > seq_len or not np.array_equal(cum[ends] - cum[ends - runs], num_tokens)))
    ):
        raise ValueError(
            f"{len(documents)} runs of {int(np.sum(lengths))} tokens and {n} sequences of "
            f"{int(num_tokens.sum())} real tokens do not tile {n} x seq_len={seq_len}: a corrupt packed block."
        )
    pad_len = seq_len - num_tokens
    if n and not pad_len.any():  # no padding (concat's full sequences): the runs tile the rows alone
        return Segments(
            np.asarray(documents, dtype=np.int64), lengths.astype(np.int32), (cum[:-1] % seq_len).astype(np.int32)
        )
    # each sequence's padding as one more segment after its runs
    pads = ends + np.arange(n)
    real = np.ones(len(lengths) + n, dtype=bool)
    real[pads] = False
    seg_len = np.empty(len(real), dtype=np.int32)
    seg_len[real], seg_len[pads] = lengths, pad_len
    seg_doc = np.empty(len(real), dtype=np.int64)
    seg_doc[real], seg_doc[pads] = documents, PAD_DOCUMENT
    first = np.empty(len(real), dtype=np.int32)
    first[real] = cum[:-1] - np.repeat(cum[ends - runs], runs)  # the run's start in its row
    first[pads] = seq_len  # past the row: padding's positions come out negative, then clipped to 0
    return Segments(seg_doc, seg_len, first)


def expand_segments(
    segments: Segments, n: int, seq_len: int, out: Optional[Sequence[np.ndarray]] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """``(document_ids int64, position_ids int32)``, ``(n, seq_len)`` each, of ``n`` sequences given as
    `Segments`: two ``np.repeat`` write every token's document and its segment's first column, one
    subtraction makes the positions, and padding's (negative: its first column is past the row) are
    clipped to 0. ``out``: the two arrays to write into."""
    docs = np.repeat(segments.documents, segments.lengths).reshape(n, seq_len)
    pos = np.repeat(segments.starts, segments.lengths).reshape(n, seq_len)
    np.subtract(np.arange(seq_len, dtype=np.int32), pos, out=pos)  # the place in its run
    if ((segments.starts >= seq_len) & (segments.lengths > 0)).any():  # padding (O(segments) to know)
        np.maximum(pos, 0, out=pos)
    if out is None:  # the repeats' own arrays: no copy
        return docs, pos
    out[0][...], out[1][...] = docs, pos
    return out[0], out[1]


def expand_segments_torch(documents: Any, lengths: Any, starts: Any, rows: int, seq_len: int) -> Tuple[Any, Any]:
    """`expand_segments` of `Segments` given as torch tensors, on their device: ``(document_ids int64,
    position_ids int32)`` tensors, ``(rows, seq_len)`` each, equal to `expand_runs`' for the same runs.

    On an accelerator, a few kernels and no host sync (the output's size is ``rows * seq_len``, known
    on the host): each token's segment (``torch.repeat_interleave`` of the lengths), two gathers, a
    subtraction and a clamp. On CPU, `expand_segments` over the tensors' memory (NumPy's ``repeat``
    was 10-100x faster than torch's CPU kernels for this on the machine it was measured on:
    docs/data.md). The rank ships `Segments` (O(runs + sequences) numbers) instead of 12 bytes per token
    (``raytrain_events.data.ray.packed_batch``)."""
    import torch  # here: the read tasks import this module without torch

    if lengths.device.type == "cpu":
        segments = Segments(documents.numpy(), lengths.numpy(), starts.numpy())
        docs, pos = expand_segments(segments, rows, seq_len)
        return torch.from_numpy(docs), torch.from_numpy(pos)
    return _expand_segments_kernels(documents, lengths, starts, rows, seq_len)


def _expand_segments_kernels(documents: Any, lengths: Any, starts: Any, rows: int, seq_len: int) -> Tuple[Any, Any]:
    """`expand_segments_torch` as torch kernels on any device (see there)."""
    import torch

    segment = torch.repeat_interleave(lengths, output_size=rows * seq_len)  # each token's segment
    docs = documents.to(torch.int64)[segment].view(rows, seq_len)
    pos = torch.arange(seq_len, dtype=torch.int32, device=lengths.device) - starts.to(torch.int32)[segment].view(
        rows, seq_len
    )
    return docs, pos.clamp_(min=0)


def is_segmented(batch: Any) -> bool:
    """Whether ``batch`` carries its documents as segments (`SEGMENT_COLUMNS`), not yet expanded: the one
    test of that form (a type check and one key lookup)."""
    return type(batch) is dict and SEGMENT_COLUMNS[1] in batch


def segment_rows(batch: Dict[str, Any], lo: int, hi: int) -> Dict[str, Any]:
    """Rows ``lo:hi`` of a segmented batch (`is_segmented`): its per-row tensors cut, and the segments of
    those rows (no segment crosses a row's end; a padding segment of no tokens at a cut is harmless on
    either side). One ``searchsorted`` over the segments: nothing per token."""
    import torch

    seq_len = batch["input_ids"].shape[1]
    lengths = batch[SEGMENT_COLUMNS[1]]
    starts = torch.cumsum(lengths, 0, dtype=torch.int64) - lengths  # each segment's first token in the batch
    bounds = torch.tensor([lo * seq_len, hi * seq_len], dtype=torch.int64, device=lengths.device)
    a, b = torch.searchsorted(starts, bounds).tolist()
    return {k: v[a:b] if k in SEGMENT_COLUMNS else v[lo:hi] for k, v in batch.items()}
