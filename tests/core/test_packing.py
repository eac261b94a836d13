"""`raytrain_events.core.packing`: both policies place every document's tokens exactly once, with
per-token document and position ids; best_fit never splits a document and refuses one longer than
seq_len; the counts a source is built from (`sequences_in_window`) are what packing makes."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_events.core.packing import PAD_DOCUMENT, PackingError, efficiency, pack_window, sequences_in_window

SEQ = 64


def _documents(seed: int, n: int = 2_000, longest: int = SEQ):
    """A long-tail length mix (many short, some long, a few empty) and tokens that name their document."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.6, size=n), longest).astype(np.int64)
    lengths[rng.choice(n, 20, replace=False)] = 0
    ids = np.arange(n, dtype=np.int64) + 1_000
    tokens = np.concatenate([np.arange(k, dtype=np.int32) + 1 for k in lengths])  # token t of a document is t + 1
    return tokens, lengths, ids


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_document_once_with_its_ids_and_positions(policy: str, seed: int) -> None:
    tokens, lengths, ids = _documents(seed)
    packed = pack_window(tokens, lengths, ids, SEQ, policy)
    assert packed.input_ids.shape == (sequences_in_window(lengths, SEQ, policy), SEQ)
    docs, pos, toks = packed.document_ids, packed.position_ids, packed.input_ids
    real = docs != PAD_DOCUMENT
    assert packed.num_tokens.tolist() == real.sum(1).tolist() and int(real.sum()) == int(lengths.sum())
    assert (toks[~real] == 0).all() and (pos[~real] == 0).all()
    # Every token once: per document, its tokens 1..k appear once each.
    got = {}
    for row in range(len(docs)):
        for d, t in zip(docs[row][real[row]].tolist(), toks[row][real[row]].tolist()):
            got.setdefault(d, []).append(t)
    assert {d: sorted(t) for d, t in got.items()} == {int(i): list(range(1, k + 1)) for i, k in zip(ids, lengths) if k}
    # Positions count from each piece's start; a piece is contiguous and in token order.
    for row in range(len(docs)):
        run_start = 0
        for j in range(SEQ):
            if j and docs[row, j] != docs[row, j - 1]:
                run_start = j
            if real[row, j]:
                assert pos[row, j] == j - run_start
                if j > run_start:
                    assert toks[row, j] == toks[row, j - 1] + 1
    pieces = sum(int(np.count_nonzero(np.diff(np.r_[-2, r[r != PAD_DOCUMENT]]))) for r in docs)
    if policy == "best_fit":  # never split: one piece per non-empty document
        assert pieces == int((lengths > 0).sum())
    else:  # greedy: padding only in the last sequence, at most one cut per sequence boundary
        assert (packed.num_tokens[:-1] == SEQ).all()
        assert pieces <= int((lengths > 0).sum()) + len(docs) - 1


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_empty_documents_anywhere_take_no_room(policy: str) -> None:
    lengths = np.array([0, 3, 0, 5, 0])
    packed = pack_window(np.arange(1, 9, dtype=np.int32), lengths, np.arange(5), 5, policy)
    assert int(packed.num_tokens.sum()) == 8 and set(packed.document_ids[packed.document_ids >= 0].tolist()) == {1, 3}


def test_best_fit_refuses_a_document_longer_than_seq_len_and_concat_splits_it() -> None:
    lengths = np.array([10, 70, 5])
    tokens = np.ones(85, dtype=np.int32)
    with pytest.raises(PackingError, match="document 1 has 70 tokens, more than seq_len=64.*Fix: policy='concat'"):
        pack_window(tokens, lengths, np.arange(3), SEQ, "best_fit")
    assert pack_window(tokens, lengths, np.arange(3), SEQ, "concat").num_tokens.tolist() == [64, 21]
    with pytest.raises(ValueError, match="policy='greedy' is not one of"):
        pack_window(tokens, lengths, np.arange(3), SEQ, "greedy")
    with pytest.raises(ValueError, match="they must agree"):
        pack_window(tokens[:-1], lengths, np.arange(3), SEQ, "concat")


def test_efficiency_of_both_policies_on_a_long_tail() -> None:
    _, lengths, _ = _documents(0, n=20_000)
    concat, best = efficiency(lengths, SEQ, "concat", 5_000), efficiency(lengths, SEQ, "best_fit", 5_000)
    assert concat["efficiency"] > 0.999 and concat["split_documents"] > 0  # waste: one tail per window
    assert 0.97 < best["efficiency"] <= concat["efficiency"] and best["split_documents"] == 0
    # Documents a bit over half of seq_len: best_fit leaves one per sequence, concat wastes nothing but splits.
    lengths = np.random.default_rng(0).integers(33, 41, size=1_000)
    best, concat = efficiency(lengths, SEQ, "best_fit", 1_000), efficiency(lengths, SEQ, "concat", 1_000)
    assert best["sequences"] == 1_000 and best["efficiency"] < 0.65 and concat["efficiency"] > 0.99


def _best_fit_one_by_one(lengths: np.ndarray, seq_len: int):
    """Best-fit decreasing the plain way (one document at a time, (room, sequence) tuples): what the
    fast placement (documents over half of seq_len as arrays, equal-length runs per room) must equal."""
    import bisect

    fills, free = [], []
    seq, offset = np.full(len(lengths), -1), np.zeros(len(lengths), dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        if n == 0:
            continue
        j = bisect.bisect_left(free, (n, -1))
        room, s = free.pop(j) if j < len(free) else (seq_len, len(fills))
        if s == len(fills):
            fills.append(0)
        seq[i], offset[i] = s, fills[s]
        fills[s] += n
        if room > n:
            bisect.insort(free, (room - n, s))
    return fills, seq, offset


@pytest.mark.parametrize("seq_len", [1, 7, SEQ, 1024])
def test_best_fit_places_every_document_as_one_by_one(seq_len: int) -> None:
    from raytrain_events.core.packing import _best_fit

    rng = np.random.default_rng(seq_len)
    for lengths in (
        np.minimum(rng.zipf(1.4, size=3_000), seq_len),  # long runs of equal short lengths
        rng.integers(0, seq_len + 1, size=500),  # every length, empty ones, many over half of seq_len
        np.full(100, max(1, seq_len // 3)),  # one run, three to a sequence
    ):
        want = _best_fit_one_by_one(lengths.astype(np.int64), seq_len)
        fills, seq, offset = _best_fit(lengths.astype(np.int64), seq_len, "a window")
        assert fills == want[0] and seq.tolist() == want[1].tolist() and offset.tolist() == want[2].tolist()


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_pack_window_into_given_arrays_writes_every_element(policy: str) -> None:
    from raytrain_events.core.packing import Packed

    tokens, lengths, ids = _documents(3)
    want = pack_window(tokens, lengths, ids, SEQ, policy, pad_id=7)
    n = len(want.num_tokens)
    block = Packed(*(np.full((n + 2,) + a.shape[1:], 99, dtype=a.dtype) for a in want))  # stale values
    pack_window(tokens, lengths, ids, SEQ, policy, pad_id=7, out=Packed(*(a[1 : n + 1] for a in block)))
    for got, expected in zip(block, want):
        assert (got[1 : n + 1] == expected).all() and (got[0] == 99).all() and (got[n + 1] == 99).all()
    with pytest.raises(PackingError, match=f"packs into {n} sequences; out holds {n + 2}"):
        pack_window(tokens, lengths, ids, SEQ, policy, out=block)


@pytest.mark.parametrize("seq_len", [1, 7, SEQ, 1024])
def test_best_fit_lays_out_each_document_at_its_place(seq_len: int) -> None:
    """The sequential layout (segments gathered in place order) writes exactly what scattering each
    document's tokens to ``sequence * seq_len + offset`` writes: the same sequences as before it."""
    from raytrain_events.core.packing import _best_fit

    rng = np.random.default_rng(seq_len + 1)
    for lengths in (
        np.minimum(rng.zipf(1.4, size=3_000), seq_len),
        rng.integers(0, seq_len + 1, size=500),
        np.full(100, max(1, seq_len // 3)),
        np.zeros(5, dtype=np.int64),  # nothing to pack
    ):
        lengths = lengths.astype(np.int64)
        tokens = rng.integers(1, 50_000, size=int(lengths.sum())).astype(np.int32)
        ids = rng.permutation(len(lengths)).astype(np.int64) + 5
        fills, seq, offset = _best_fit(lengths, seq_len, "a window")
        want = [np.full(len(fills) * seq_len, v, dtype=d) for v, d in ((3, np.int32), (-1, np.int64), (0, np.int32))]
        starts = np.cumsum(lengths) - lengths
        for i in np.flatnonzero(lengths):  # the plain scatter, one document at a time
            at, k = int(seq[i] * seq_len + offset[i]), int(lengths[i])
            want[0][at : at + k] = tokens[starts[i] : starts[i] + k]
            want[1][at : at + k], want[2][at : at + k] = ids[i], np.arange(k)
        got = pack_window(tokens, lengths, ids, seq_len, "best_fit", pad_id=3)
        for array, expected in zip(got[:3], want):
            assert array.reshape(-1).tolist() == expected.tolist()
        assert got.num_tokens.tolist() == fills
