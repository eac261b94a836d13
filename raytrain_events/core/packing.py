"""Packing token documents into fixed-length training sequences: pure functions of document lengths.

A *pack window* is a run of consecutive documents (the data path makes one of consecutive Parquet
row groups, `raytrain_events.ray.data.packed_source`); each window is packed on its own, so the
sequences of a window are a function of that window's documents only. Nothing carries over from
one window to the next: a resume at any sequence re-packs the one window holding it (the same
sequences, since packing is deterministic) and reads nothing before it.

Two policies (`POLICIES`):

* ``"concat"``: greedy concatenation with splitting. The window's documents are laid end to end
  and cut every ``seq_len`` tokens; a document crossing a cut continues as a new piece at the
  start of the next sequence. Wastes only the last sequence's tail of each window (fewer than
  ``seq_len`` padding tokens per window); the cost is context: a piece after a cut cannot see the
  part of its document before it (about one cut document per sequence).
* ``"best_fit"``: best-fit decreasing without splitting. Documents, longest first (ties in
  document order), each go to the fullest open sequence that still has room, else a new one.
  No document is cut; the waste is the room left in each sequence (padding), small when short
  documents fill the gaps (a long-tail length distribution) and large when most documents are a
  bit over half of ``seq_len``. A document longer than ``seq_len`` cannot be placed: refused
  (`PackingError`), known from the lengths alone, before any training.

Per token the packed sequence carries ``document_ids`` (the document's id, ``PAD_DOCUMENT`` on
padding), ``position_ids`` (the position inside its piece: 0 at a document's first token in this
sequence, so a piece after a cut starts again at 0: it attends to nothing before it), and the
token itself (``pad_id`` on padding). Real tokens are the non-padding ones
(``document_ids != PAD_DOCUMENT``); a sequence's count is kept with it (``num_tokens``).

Cost: ``concat`` is O(tokens) array work per window (no Python loop over documents); ``best_fit``
is O(d log d) for the window's ``d`` documents (a sorted list of open sequences' free room,
searched by bisection), then O(tokens) array work to lay the tokens out.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

__all__ = [
    "POLICIES",
    "PAD_DOCUMENT",
    "PackingError",
    "Packed",
    "check_policy",
    "sequences_in_window",
    "place",
    "pack_window",
]

POLICIES = ("concat", "best_fit")
PAD_DOCUMENT = -1  # document id of padding tokens


class PackingError(ValueError):
    """Documents that cannot be packed as asked (a document longer than ``seq_len`` under best_fit)."""


class Packed(NamedTuple):
    """A window's sequences, ``(n, seq_len)`` arrays, plus each sequence's real-token count."""

    input_ids: np.ndarray  # the tokens (pad_id on padding)
    document_ids: np.ndarray  # int64: the document each token belongs to (PAD_DOCUMENT on padding)
    position_ids: np.ndarray  # int32: position inside the document's piece in this sequence
    num_tokens: np.ndarray  # int32 per sequence: its real (non-padding) tokens


def check_policy(policy: str, seq_len: int) -> None:
    """Refuse an unknown policy or a ``seq_len`` that is not a positive integer, naming the fix."""
    if policy not in POLICIES:
        raise ValueError(
            f"packing policy={policy!r} is not one of {POLICIES}: 'concat' splits documents at "
            "sequence ends, 'best_fit' never splits them (refusing documents longer than seq_len)."
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: give the packed sequence length in tokens, an integer >= 1.")


def _check_fits(lengths: np.ndarray, seq_len: int, what: str) -> None:
    if len(lengths) and int(lengths.max()) > seq_len:
        i = int(np.argmax(lengths))
        raise PackingError(
            f"{what}: document {i} has {int(lengths[i])} tokens, more than seq_len={seq_len}, and policy='best_fit' "
            "never splits a document. Fix: policy='concat' (splits documents at sequence ends), a larger seq_len, "
            "or drop/truncate long documents when tokenizing (tokenize(max_tokens=...))."
        )


def sequences_in_window(lengths: Sequence[int] | np.ndarray, seq_len: int, policy: str, what: str = "a window") -> int:
    """How many sequences a window of documents of these lengths packs into (empty documents count 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if policy == "concat":
        return int(-(-int(lengths.sum()) // seq_len))
    return len(_best_fit(lengths, seq_len, what)[0])


def _best_fit(lengths: np.ndarray, seq_len: int, what: str) -> Tuple[List[int], np.ndarray, np.ndarray]:
    """``(fill of each sequence, sequence of each document, offset of each document in it)``."""
    _check_fits(lengths, seq_len, what)
    order = np.argsort(-lengths, kind="stable")  # longest first, ties in document order
    fills: List[int] = []
    free: List[Tuple[int, int]] = []  # (room left, sequence) of open sequences, sorted
    seq = np.zeros(len(lengths), dtype=np.int64)
    offset = np.zeros(len(lengths), dtype=np.int64)
    for i in order.tolist():
        n = int(lengths[i])
        if n == 0:
            seq[i], offset[i] = -1, 0  # an empty document takes no room
            continue
        j = bisect.bisect_left(free, (n, -1))  # the tightest room that fits: the fullest sequence
        if j < len(free):
            room, s = free.pop(j)
        else:
            s, room = len(fills), seq_len
            fills.append(0)
        seq[i], offset[i] = s, fills[s]
        fills[s] += n
        if room - n > 0:
            bisect.insort(free, (room - n, s))
    return fills, seq, offset


def place(lengths: Sequence[int] | np.ndarray, seq_len: int, policy: str, what: str = "a window") -> np.ndarray:
    """Where each token of the window's documents (laid end to end, in order) goes in the window's
    packed ``(n, seq_len)`` output, as flat indices; the rest of the output is padding."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if policy == "concat":
        return np.arange(total, dtype=np.int64)
    _, seq, offset = _best_fit(lengths, seq_len, what)
    starts = np.cumsum(lengths) - lengths
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    dest: np.ndarray = np.repeat(seq * seq_len + offset, lengths) + within
    return dest


def pack_window(  # noqa: PLR0913 (the window's arrays, then how to pack them)
    tokens: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    document_ids: Sequence[int] | np.ndarray,
    seq_len: int,
    policy: str,
    pad_id: int = 0,
    what: str = "a window",
) -> Packed:
    """Pack one window: ``tokens`` are its documents' tokens end to end, ``lengths`` each document's
    count and ``document_ids`` their ids (int64, >= 0). Returns the window's `Packed` sequences."""
    check_policy(policy, seq_len)
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.asarray(document_ids, dtype=np.int64)
    if len(ids) != len(lengths) or int(lengths.sum()) != len(tokens):
        raise ValueError(
            f"{what}: {len(tokens)} tokens, {len(lengths)} lengths summing to {int(lengths.sum())}, "
            f"{len(ids)} document ids: they must agree."
        )
    n = sequences_in_window(lengths, seq_len, policy, what)
    dest = place(lengths, seq_len, policy, what)
    out_ids = np.full(n * seq_len, pad_id, dtype=tokens.dtype)
    out_docs = np.full(n * seq_len, PAD_DOCUMENT, dtype=np.int64)
    out_ids[dest] = tokens
    out_docs[dest] = np.repeat(ids, lengths)
    # Each token's position in its piece: since its document's start, or since its sequence's start
    # when the document began in an earlier sequence (a concat cut); array work, no per-row scan.
    some = lengths > 0  # (an empty document has no first token)
    starts = np.repeat(dest[(np.cumsum(lengths) - lengths)[some]], lengths[some])
    out_pos = np.zeros(n * seq_len, dtype=np.int32)
    out_pos[dest] = dest - np.maximum(starts, dest - dest % seq_len)
    docs = out_docs.reshape(n, seq_len)
    return Packed(
        out_ids.reshape(n, seq_len), docs, out_pos.reshape(n, seq_len), (docs != PAD_DOCUMENT).sum(1).astype(np.int32)
    )


def efficiency(lengths: Sequence[int] | np.ndarray, seq_len: int, policy: str, window_docs: int) -> Dict[str, float]:
    """Packing efficiency (real tokens / sequence capacity) of documents of these lengths packed in
    windows of ``window_docs`` documents, and the documents split (``concat``), for benchmarks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sequences = split = 0
    for a in range(0, len(lengths), window_docs):
        part = lengths[a : a + window_docs]
        sequences += sequences_in_window(part, seq_len, policy)
        if policy == "concat":
            ends = np.cumsum(part)
            split += int(((ends - part) // seq_len != (ends - 1) // seq_len)[part > 0].sum())
    capacity = sequences * seq_len
    return {
        "efficiency": float(lengths.sum()) / capacity if capacity else 1.0,
        "sequences": float(sequences),
        "split_documents": float(split),
    }
