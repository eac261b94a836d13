"""Packing token documents into fixed-length training sequences: pure functions of document lengths.

A *pack window* is a run of consecutive documents (the data path makes one of consecutive Parquet
row groups, `raytrain_events.data.ray.packed_source`); each window is packed on its own, so the
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

Cost: ``concat`` is O(tokens) array work per window (no Python loop over documents or sequences:
one copy of the tokens into the output, its runs O(documents + sequences) index work, no sort); ``best_fit`` is O(d log d) for the
window's ``d`` documents (a sorted list of open sequences' free room, searched by bisection; one
Python step per (document length, open sequence) pair, documents over half ``seq_len`` as arrays;
radix sorts of 16-bit keys), then O(tokens) array work laying the sequences out as runs of whole
documents and padding (one gather in output order, no per-token scatter). `pack_window` can write
into caller-given arrays (``out``), so a read that packs several windows makes one block without a
copy after packing.

Compact form (`Runs`, `pack_runs`): the tokens plus each sequence's documents as *runs* (a
document's piece in one sequence: its id and length, ``cu_seqlens`` style), 4 bytes per token and
12 per run, where the expanded ``document_ids``/``position_ids`` add 12 bytes per token.
`expand_runs` makes them for a whole batch at once (two ``np.repeat`` over all its runs, no step per
sequence): `core.segments.run_segments` (the runs and each sequence's padding as *segments*,
O(runs + sequences)) then `core.segments.expand_segments` (the per-token passes); `pack_window` is
`pack_runs` then `expand_runs`, so both forms come from one path. The data path ships runs to the
ranks, a rank ships segments to its device, and `core.segments.expand_segments_torch` makes the
per-token columns there (`raytrain_events.data.ray.packed_batch`).
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from raytrain_events.core.segments import PAD_DOCUMENT, expand_segments, run_segments

__all__ = [
    "POLICIES",
    "PAD_DOCUMENT",
    "PackingError",
    "Packed",
    "check_policy",
    "sequences_in_window",
    "pack_window",
    "Runs",
    "pack_runs",
    "expand_runs",
    "empty_packed",
]

POLICIES = ("concat", "best_fit")


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
    return len(_place(lengths, seq_len, what, offsets=False)[0])


def _best_fit(lengths: np.ndarray, seq_len: int, what: str) -> Tuple[List[int], np.ndarray, np.ndarray]:
    """``(fill of each sequence, sequence of each document, offset of each document in it)``: `_place`."""
    fills, seq, offset, _ = _place(lengths, seq_len, what)
    assert offset is not None
    return fills, seq, offset


def _best_fit_runs(
    runs: Iterable[Tuple[int, int]], free: List[int], fills: List[int], seq_len: int, stride: int
) -> List[int]:
    """Place each run of ``(length n, documents)`` in the tightest open rooms (``free``: ``room * stride + sequence``,
    sorted), opening new sequences when none fits; ``fills`` and ``free`` are updated in place. Returns the steps,
    flat: per step its sequence, that sequence's fill before it, the length and how many documents it placed."""
    steps: List[int] = []  # per step: sequence, its fill before, the length, how many documents
    spare: List[int] = []  # what the run left of the rooms it took, inserted once the run is placed
    bisect_left, insort, record = bisect.bisect_left, bisect.insort, steps.extend
    for n, left in runs:
        # The rooms that fit one document of the run are free[j:], tightest first. Each takes as many as
        # fit and keeps less than n (or the run ends in it), so the run visits them once each, in
        # order: one search per run, where one per step found the same room (what is left of a room
        # is below n, so it sorts before j and no later search of the run sees it).
        j = k = bisect_left(free, n * stride)
        while left and k < len(free):
            room, s = divmod(free[k], stride)
            q = room // n if room // n < left else left
            record((s, fills[s], n, q))
            fills[s] += q * n
            left -= q
            k += 1
            if room > q * n:
                spare.append((room - q * n) * stride + s)
        del free[j:k]
        while left:  # no open room fits: new sequences, each as full as the run allows
            s, q = len(fills), seq_len // n if seq_len // n < left else left
            record((s, 0, n, q))
            fills.append(q * n)
            left -= q
            if seq_len > q * n:
                spare.append((seq_len - q * n) * stride + s)
        for key in spare:
            insort(free, key)
        spare.clear()
    return steps


def _place(
    lengths: np.ndarray, seq_len: int, what: str, offsets: bool = True
) -> Tuple[List[int], np.ndarray, Optional[np.ndarray], np.ndarray]:
    """``(fill of each sequence, sequence of each document, offset of each document in it, the
    non-empty documents in the order they were placed)``; the offsets only if ``offsets`` (`_lay_out`
    needs none: a sequence's documents lie in place order, and counting sequences needs neither).

    Documents over half of ``seq_len`` each open their own sequence (no open sequence has room for
    one: each already holds a document at least as long), so they are placed as arrays. The rest go
    to the tightest room (ties: the lowest sequence), open rooms kept as ``room * stride + sequence``
    integers in a sorted list, a run of documents of one length ``n`` at a time: the tightest room
    that fits one takes as many of the run as fit (``room // n``; what is left of it is then below
    ``n``, so the next of the run goes to the next tightest room), exactly as one by one. So one
    Python step per (length, room) pair, not per document: many fewer on long-tail mixes; and one
    search per run (the rooms it takes are consecutive in the list), not one per step."""
    _check_fits(lengths, seq_len, what)
    order = np.argsort(-lengths.astype(_small(seq_len)), kind="stable")  # longest first, ties in document order
    seq = np.full(len(lengths), -1, dtype=np.int64)  # empty documents take no room: sequence -1
    ordered = lengths[order]
    big = int(np.searchsorted(-ordered, -(seq_len // 2), side="left"))  # lengths > seq_len // 2
    fills: List[int] = ordered[:big].tolist()
    seq[order[:big]] = np.arange(big)
    stride = len(lengths) + 1  # more than any sequence number
    rooms = seq_len - ordered[:big]
    free: List[int] = np.sort((rooms * stride + np.arange(big))[rooms > 0]).tolist()
    nonempty = big + int(np.count_nonzero(ordered[big:]))
    rest = ordered[big:nonempty]
    starts = np.flatnonzero(np.diff(rest, prepend=-1))  # where each length's run starts
    runs = zip(rest[starts].tolist(), np.diff(starts, append=len(rest)).tolist())  # (length, documents)
    steps = _best_fit_runs(runs, free, fills, seq_len, stride)
    s_, f_, n_, q_ = np.fromiter(steps, dtype=np.int64, count=len(steps)).reshape(-1, 4).T
    placed = order[big:nonempty]  # in step order: a step's documents are the next q of the run
    seq[placed] = np.repeat(s_, q_)
    if not offsets:
        return fills, seq, None, order[:nonempty]
    offset = np.zeros(len(lengths), dtype=np.int64)
    first = np.cumsum(q_) - q_  # each step's first document among ``placed``
    offset[placed] = np.repeat(f_ - first * n_, q_) + np.arange(len(placed)) * np.repeat(n_, q_)
    return fills, seq, offset, order[:nonempty]


def _small(bound: int) -> Any:
    """The narrowest signed integer type holding ``-bound..bound``: numpy's stable argsort of 16-bit
    integers is a radix sort, O(n), several times faster than the merge sort of wider ones."""
    return np.int16 if bound < 2**15 else np.int32 if bound < 2**31 else np.int64


class Runs(NamedTuple):
    """A window's sequences in compact form: the tokens, and each sequence's documents as runs
    (``cu_seqlens`` style: a run is a document's piece in one sequence, sequences in order, runs in
    place order, the padding after them). ``document_ids`` and ``position_ids`` follow from it
    (`expand_runs`): 4 bytes per token plus 12 per run, where the expanded form holds 16 per token."""

    input_ids: np.ndarray  # (n, seq_len): the tokens (pad_id on padding)
    documents: np.ndarray  # int64, one per run: its document's id
    lengths: np.ndarray  # int32, one per run: its tokens (> 0)
    runs: np.ndarray  # int32 per sequence: how many runs it holds
    num_tokens: np.ndarray  # int32 per sequence: its real tokens (the sum of its runs' lengths)


def pack_window(  # noqa: PLR0913 (the window's arrays, then how to pack them)
    tokens: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    document_ids: Sequence[int] | np.ndarray,
    seq_len: int,
    policy: str,
    pad_id: int = 0,
    what: str = "a window",
    out: Optional[Packed] = None,
) -> Packed:
    """Pack one window: ``tokens`` are its documents' tokens end to end, ``lengths`` each document's
    count and ``document_ids`` their ids (int64, >= 0). Returns the window's `Packed` sequences,
    written into ``out`` when given (C-contiguous arrays of the window's shapes: a read packing
    several windows into one block gives views of it, and nothing is copied after packing).

    `pack_runs` then `expand_runs`: the one path that makes every packed sequence, compact or not."""
    packed = pack_runs(tokens, lengths, document_ids, seq_len, policy, pad_id, what, None if out is None else out[0])
    n = len(packed.num_tokens)
    out = empty_packed(n, seq_len, packed.input_ids.dtype) if out is None else out
    _checked(out, n, seq_len, packed.input_ids.dtype, what)
    if out.input_ids is not packed.input_ids:
        out.input_ids[...] = packed.input_ids
    expand_runs(packed.documents, packed.lengths, packed.runs, packed.num_tokens, seq_len, out[1:3])
    out.num_tokens[:] = packed.num_tokens
    return out


def pack_runs(  # noqa: PLR0913 (the window's arrays, then how to pack them)
    tokens: np.ndarray | Sequence[np.ndarray],
    lengths: Sequence[int] | np.ndarray,
    document_ids: Sequence[int] | np.ndarray,
    seq_len: int,
    policy: str,
    pad_id: int = 0,
    what: str = "a window",
    out: Optional[np.ndarray] = None,
) -> Runs:
    """Pack one window into `Runs` (arguments as `pack_window`; ``out``: the ``(n, seq_len)`` token
    array to write into). The tokens are laid out by whole-window array work, with no loop over
    documents or sequences: ``concat`` copies them in place, its runs are the documents cut at every
    ``seq_len``-th token; ``best_fit`` gathers each sequence's documents in place order (`_lay_out`,
    after `_place` chose the places). ``tokens`` may be a list of arrays of one dtype, the window's
    tokens in order (a Parquet read's decoded chunks): each is copied once, straight to its place."""
    check_policy(policy, seq_len)
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.asarray(document_ids, dtype=np.int64)
    chunks = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
    dtype = chunks[0].dtype if chunks else np.dtype(np.int32)
    if any(c.dtype != dtype or c.ndim != 1 for c in chunks):
        raise ValueError(f"{what}: token arrays of {sorted({str(c.dtype) for c in chunks})}: give one dtype, 1-d.")
    total, given = int(lengths.sum()), sum(len(c) for c in chunks)
    if len(ids) != len(lengths) or total != given:
        raise ValueError(
            f"{what}: {given} tokens, {len(lengths)} lengths summing to {total}, "
            f"{len(ids)} document ids: they must agree."
        )
    if policy == "best_fit":
        fills, seq, _, placement = _place(lengths, seq_len, what, offsets=False)
        n = len(fills)
    else:
        n = -(-total // seq_len)
    if out is None:
        out = np.empty((n, seq_len), dtype=dtype)
    elif len(out) != n:
        raise PackingError(f"{what} packs into {n} sequences; out holds {len(out)}.")
    elif out.shape != (n, seq_len) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(
            f"{what} packs into {n} sequences of {seq_len} {dtype} tokens; out is {out.dtype}{list(out.shape)}."
        )
    if policy == "best_fit":
        return _lay_out(chunks, lengths, ids, seq_len, fills, seq, placement, pad_id, out)
    flat = out.reshape(-1)
    _copy_chunks(chunks, flat)
    flat[total:] = pad_id
    return _concat_runs(lengths, ids, seq_len, n, out)


def _concat_runs(lengths: np.ndarray, ids: np.ndarray, seq_len: int, n: int, out: np.ndarray) -> Runs:
    """``concat``'s runs: each non-empty document, cut where a sequence ends inside it. The cuts
    inside documents are merged into the documents' starts (both sorted) by one ``np.insert``, with
    the cut document's id: O(documents + sequences), no sort."""
    nonempty = lengths > 0
    sizes, docs = lengths[nonempty], ids[nonempty]
    starts = np.cumsum(sizes) - sizes  # each non-empty document's first token
    total = int(starts[-1] + sizes[-1]) if len(sizes) else 0
    cuts = np.arange(seq_len, total, seq_len)  # where sequences 1.. start (sequence 0 starts a document)
    at = np.searchsorted(starts, cuts)  # the first document starting at or after each cut
    inside = starts[np.minimum(at, len(starts) - 1)] != cuts  # a cut inside a document (or after the last start)
    at = at[inside]
    bounds = np.insert(starts, at, cuts[inside])  # each run's first token
    run_doc = np.insert(docs, at, docs[at - 1])  # a cut piece continues the document before it
    run_len = np.diff(bounds, append=total).astype(np.int32)
    num = np.full(n, seq_len, dtype=np.int32)
    if n:
        num[-1] = total - (n - 1) * seq_len
    return Runs(out, run_doc, run_len, np.bincount(bounds // seq_len, minlength=n).astype(np.int32), num)


def expand_runs(  # noqa: PLR0913 (the runs, then the output)
    documents: np.ndarray,
    lengths: np.ndarray,
    runs: np.ndarray,
    num_tokens: np.ndarray,
    seq_len: int,
    out: Optional[Sequence[np.ndarray]] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """``(document_ids int64, position_ids int32)``, ``(n, seq_len)`` each, of sequences given as
    runs (`Runs`' fields): each token gets its run's document and its place in the run; padding
    (after a sequence's ``num_tokens``) gets ``PAD_DOCUMENT`` and position 0. ``out``: the two
    arrays to write into.

    All sequences at once (a batch's, on a rank): `run_segments` (the runs and each sequence's
    padding laid end to end as segments: O(runs + sequences) index work), then `expand_segments`
    (two ``np.repeat``, a subtraction and a clip: four passes over the tokens, 16 bytes written per
    token). No step per sequence."""
    segments = run_segments(documents, lengths, runs, num_tokens, seq_len)
    return expand_segments(segments, len(runs), seq_len, out)


def _copy_chunks(chunks: List[np.ndarray], out: np.ndarray) -> None:
    """``chunks`` end to end into the start of ``out``."""
    at = 0
    for chunk in chunks:
        out[at : at + len(chunk)] = chunk
        at += len(chunk)


def _lay_out(  # noqa: PLR0913 (the window's arrays, the placement, the output)
    chunks: List[np.ndarray],
    lengths: np.ndarray,
    ids: np.ndarray,
    seq_len: int,
    fills: List[int],
    seq: np.ndarray,
    placement: np.ndarray,
    pad_id: int,
    out: np.ndarray,
) -> Runs:
    """Write best_fit's placement into ``out`` (the tokens) as sequential array work (a gather, no
    scatter), and return its runs.

    A sequence's documents tile ``[0, fill)`` (each placed at its sequence's fill so far), so the
    flat output is a run of *segments*, one per placed document in output order (by sequence, then
    offset), the last of each sequence running on over its padding (``seq_len - fill`` tokens, maybe
    none). Each segment's tokens are the window's tokens at a fixed *shift* from their places in the
    output (its document's start there less its own start here), so every output token gathers the
    window's token at its place plus its segment's shift: one ``np.repeat`` of the shifts and one
    addition of the places, `_GATHER_ROWS` sequences at a time (their indices in one small buffer
    reused, and the places made once: cache-resident and never page-faulted again; one index array
    for the whole window cost more in fresh pages than in the gather). The padding so gathers the
    tokens after its sequence's last document (clipped to the window: any token will do), then is
    set to ``pad_id`` by one scatter over its own tokens (few: best_fit fills its sequences). The
    tokens are gathered straight from the decoded chunk when the window is one (no copy). O(tokens)
    for the window, O(d) to order its ``d`` documents (a radix sort of 16-bit keys; O(d log d) past
    2**15 sequences)."""
    n = len(fills)
    # Output order: by sequence, then offset. Placed in ``placement`` order, a sequence's documents
    # took its room in order, so a stable sort by sequence alone is that order.
    placed = placement[np.argsort(seq[placement].astype(_small(n)), kind="stable")]
    runs = np.bincount(seq[placed], minlength=n)
    size = lengths[placed]
    fill = np.asarray(fills, dtype=np.intp)
    padding = seq_len - fill
    ends = np.cumsum(runs)  # each sequence's end among the placed documents
    seg_len = size.astype(np.intp)
    if n:
        seg_len[ends - 1] += padding  # each sequence's last document's segment runs on over its padding
    shift = (np.cumsum(lengths) - lengths)[placed] - (np.cumsum(seg_len) - seg_len)
    source = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(1, out.dtype)
    if not len(source):
        source = np.zeros(1, out.dtype)
    flat = out.reshape(-1)
    index = np.empty(min(n, _GATHER_ROWS) * seq_len, dtype=np.intp)
    places = np.arange(len(index), dtype=np.intp)
    starts = ends - runs
    for a in range(0, n, _GATHER_ROWS):
        b = min(n, a + _GATHER_ROWS)
        rows, first, end = index[: (b - a) * seq_len], int(starts[a]), int(ends[b - 1])
        np.add(np.repeat(shift[first:end], seg_len[first:end]), places[: len(rows)], out=rows)
        if a:
            rows += a * seq_len  # the block's places start at its first row
        # intp indices and mode="clip" (the padding's may run past the window's tokens): numpy's fast path
        np.take(source, rows, out=flat[a * seq_len : b * seq_len], mode="clip")
    pad_rows = np.flatnonzero(padding)  # each sequence's padding: its tail, one scatter over the padding's tokens only
    pad_index = np.empty(int(padding.sum()), dtype=np.intp)
    _segment_index(pad_rows * seq_len + fill[pad_rows], padding[pad_rows], pad_index)
    flat[pad_index] = pad_id
    return Runs(out, ids[placed], size.astype(np.int32), runs.astype(np.int32), fill.astype(np.int32))


_GATHER_ROWS = 32  # sequences whose gather indices are built at once (256 KiB of indices at seq_len 1024)


def _segment_index(seg_src: np.ndarray, seg_len: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Fill ``index`` (intp, as long as the segments in all) with segment after segment (lengths
    ``seg_len``), each counting up from its source start ``seg_src``: each segment's offset from its
    place in ``index`` repeated over it (``np.repeat``), plus the place. Two passes over 8 bytes per
    token (a running sum over a step array measured 4x slower: NumPy's ``cumsum`` does not vectorise)."""
    starts = np.cumsum(seg_len) - seg_len
    np.add(np.repeat(seg_src - starts, seg_len), np.arange(len(index), dtype=np.intp), out=index)
    return index


def empty_packed(n: int, seq_len: int, dtype: Any) -> Packed:
    """Uninitialised `Packed` arrays for ``n`` sequences, for `pack_window`'s ``out`` (it writes every element)."""
    return Packed(
        np.empty((n, seq_len), dtype=dtype),
        np.empty((n, seq_len), dtype=np.int64),
        np.empty((n, seq_len), dtype=np.int32),
        np.empty(n, dtype=np.int32),
    )


def _checked(out: Packed, n: int, seq_len: int, dtype: Any, what: str) -> Packed:
    if len(out.num_tokens) != n:
        raise PackingError(f"{what} packs into {n} sequences; out holds {len(out.num_tokens)}.")
    want: List[Tuple[Tuple[int, ...], Any]] = [((n, seq_len), np.dtype(dtype)), ((n, seq_len), np.dtype(np.int64))]
    want += [((n, seq_len), np.dtype(np.int32)), ((n,), np.dtype(np.int32))]
    for name, array, (shape, kind) in zip(Packed._fields, out, want):
        if array.shape != shape or array.dtype != kind or not array.flags.c_contiguous:
            raise ValueError(
                f"{what}: out.{name} is {array.dtype}{list(array.shape)}, but the window packs into "
                f"{kind}{list(shape)} (C-contiguous): give buffers of the window's sequence count."
            )
    return out


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
