"""`core.packing`'s whole-batch array paths write exactly what the per-sequence paths they replaced
wrote: `expand_runs` (runs to ``document_ids``/``position_ids``, every sequence at once),
``concat``'s runs (`_concat_runs`: cuts merged into the documents' starts, no sort) and best_fit's
placement (`_place`: a run of equal lengths placed by one search), compared element by element with
the earlier code (kept here as the reference) or the policy's plain definition (test_packing's) on Zipf, uniform and
edge inputs."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest

from raytrain_events.core.packing import PAD_DOCUMENT, _place, expand_runs, pack_runs
from tests.core.test_packing import _best_fit_one_by_one  # the plain definition, one document at a time


def _reference_expand(documents, lengths, runs, num_tokens, seq_len) -> Tuple[np.ndarray, np.ndarray]:
    """The earlier `expand_runs`: padding as segments, then its positions zeroed one sequence at a time."""
    n = len(runs)
    num_tokens = np.asarray(num_tokens)
    pads = np.cumsum(runs, dtype=np.intp) + np.arange(n)
    real = np.ones(len(documents) + n, dtype=bool)
    real[pads] = False
    seg_len = np.empty(len(real), dtype=np.intp)
    seg_len[real], seg_len[pads] = lengths, seq_len - num_tokens
    seg_doc = np.empty(len(real), dtype=np.int64)
    seg_doc[real], seg_doc[pads] = documents, PAD_DOCUMENT
    first = ((np.cumsum(seg_len) - seg_len) % seq_len).astype(np.int32)
    docs, pos = np.repeat(seg_doc, seg_len).reshape(n, seq_len), np.repeat(first, seg_len).reshape(n, seq_len)
    np.subtract(np.arange(seq_len, dtype=np.int32), pos, out=pos)
    for row in np.flatnonzero(num_tokens < seq_len).tolist():
        pos[row, int(num_tokens[row]) :] = 0
    return docs, pos


def _reference_concat_runs(lengths, ids, seq_len) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The earlier ``concat`` runs: the documents' starts and the sequence starts, sorted (``union1d``)."""
    total = int(lengths.sum())
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]
    bounds = np.union1d(starts, np.arange(0, total, seq_len))
    run_len = np.diff(bounds, append=total).astype(np.int32)
    run_doc = ids[lengths > 0][np.searchsorted(starts, bounds, side="right") - 1]
    n = -(-total // seq_len)
    return run_doc, run_len, np.bincount(bounds // seq_len, minlength=n).astype(np.int32)


def _inputs(seq_len: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seq_len)
    zipf = np.minimum(rng.zipf(1.5, size=4_000), 2 * seq_len)
    zipf[rng.random(len(zipf)) < 0.02] = 0
    return [
        zipf,  # long tail, a few empty
        rng.integers(0, 2 * seq_len + 1, size=600),  # every length up to two sequences
        np.full(50, seq_len),  # each document exactly one sequence: no cut inside one
        np.array([seq_len * 3 + 1]),  # one document over three sequences and one token
        np.array([0, 0, 1, 0]),  # one token among empty documents
        np.zeros(3, dtype=np.int64),  # nothing to pack
    ]


@pytest.mark.parametrize("seq_len", [1, 7, 64, 1024])
@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_whole_batch_paths_write_what_the_per_sequence_paths_wrote(seq_len: int, policy: str) -> None:
    rng = np.random.default_rng(seq_len + 11)
    for lengths in _inputs(seq_len):
        lengths = lengths.astype(np.int64)
        if policy == "best_fit":
            lengths = np.minimum(lengths, seq_len)
        tokens = rng.integers(1, 50_000, size=int(lengths.sum())).astype(np.int32)
        ids = rng.permutation(len(lengths)).astype(np.int64) * 3 + 5
        runs = pack_runs(tokens, lengths, ids, seq_len, policy)
        if policy == "concat":
            for got, want in zip(runs[1:4], _reference_concat_runs(lengths, ids, seq_len)):
                assert got.dtype == want.dtype and got.tolist() == want.tolist()
        # Every batch a rank could get: the whole window, and cuts of a few sequences anywhere.
        n = len(runs.runs)
        ends = np.r_[0, np.cumsum(runs.runs)]
        for a, b in [(0, n)] + [tuple(sorted(rng.integers(0, n + 1, size=2))) for _ in range(5)]:
            r = slice(int(ends[a]), int(ends[b]))
            args = (runs.documents[r], runs.lengths[r], runs.runs[a:b], runs.num_tokens[a:b], seq_len)
            for got, want in zip(expand_runs(*args), _reference_expand(*args)):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got, want), (policy, seq_len, len(lengths), a, b)


@pytest.mark.parametrize("seq_len", [1, 7, 64, 1024])
@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_the_device_expansion_of_segments_writes_what_expand_runs_writes(seq_len: int, policy: str) -> None:
    """A rank ships a batch's `Segments` (`run_segments`: O(runs + sequences) numbers) and the device makes the
    per-token columns: the torch kernels (`_expand_segments_kernels`, what an accelerator runs; here on CPU
    tensors) and `expand_segments_torch` (which takes NumPy's repeat on CPU) give exactly `expand_runs`' arrays
    (dtypes int64/int32, shapes, values: padding ``PAD_DOCUMENT`` and position 0) for every cut a rank could
    get: whole windows, a few rows anywhere, no rows, concat's full rows and best_fit's padded ones."""
    import torch

    from raytrain_events.core.segments import Segments, _expand_segments_kernels, expand_segments_torch, run_segments

    rng = np.random.default_rng(seq_len + 29)
    for lengths in _inputs(seq_len):
        lengths = lengths.astype(np.int64)
        if policy == "best_fit":
            lengths = np.minimum(lengths, seq_len)
        tokens = rng.integers(1, 50_000, size=int(lengths.sum())).astype(np.int32)
        runs = pack_runs(tokens, lengths, rng.permutation(len(lengths)).astype(np.int64) * 7 + 2, seq_len, policy)
        n = len(runs.runs)
        ends = np.r_[0, np.cumsum(runs.runs)]
        rows = max(1, 2**16 // seq_len)  # a batch's worth of tokens (torch's CPU kernels are slow: docs/data.md)
        starts = rng.integers(0, n + 1, size=5)
        cuts = [(0, min(n, rows)), (0, 0), (n, n)] + [(a, min(n, a + rng.integers(1, 65))) for a in starts]
        for a, b in cuts:
            r = slice(int(ends[a]), int(ends[b]))
            args = (runs.documents[r], runs.lengths[r], runs.runs[a:b], runs.num_tokens[a:b], seq_len)
            want = expand_runs(*args)
            segments = run_segments(*args)
            assert len(segments.lengths) <= (b - a) + int(ends[b] - ends[a])  # runs + each row's padding
            assert [x.dtype for x in segments] == [np.int64, np.int32, np.int32]
            shipped = Segments(*(torch.from_numpy(np.ascontiguousarray(x)) for x in segments))
            for got in (
                _expand_segments_kernels(*shipped, b - a, seq_len),
                expand_segments_torch(*shipped, b - a, seq_len),
            ):
                for tensor, array in zip(got, want):
                    assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape
                    assert np.array_equal(tensor.numpy(), array), (policy, seq_len, len(lengths), a, b)


@pytest.mark.parametrize("seq_len", [1, 7, 64, 1024])
def test_best_fit_places_every_document_where_one_by_one_placing_puts_it(seq_len: int) -> None:
    """`_place` (a run of equal lengths visits the rooms that fit once each, one search per run) puts
    every document in the sequence and at the offset best-fit decreasing one document at a time does:
    the same packed sequences as before, so runs packed before resume onto the same ones."""
    rng = np.random.default_rng(seq_len + 3)
    cases = [np.minimum(c, seq_len) for c in _inputs(seq_len)]
    cases += [rng.integers(1, seq_len // 2 + 2, size=3_000), np.repeat(rng.integers(1, 4, size=40), 50)]  # many ties
    for lengths in cases:
        lengths = np.minimum(lengths.astype(np.int64), seq_len)
        fills, seq, offset, _ = _place(lengths, seq_len, "a window")
        want_fills, want_seq, want_offset = _best_fit_one_by_one(lengths, seq_len)
        assert (fills, seq.tolist(), offset.tolist()) == (want_fills, want_seq.tolist(), want_offset.tolist())


def test_a_block_whose_runs_do_not_tile_its_sequences_is_refused() -> None:
    """Runs that sum right overall but not per sequence are refused, not expanded into wrong rows."""
    with pytest.raises(ValueError, match="do not tile .* a corrupt packed block"):
        expand_runs(np.array([1, 2]), np.array([6, 2]), np.array([1, 1]), np.array([4, 4]), 8)
    with pytest.raises(ValueError, match="do not tile"):
        expand_runs(np.array([1]), np.array([9]), np.array([1]), np.array([9]), 8)


@pytest.mark.parametrize("seq_len", [3, 64, 1024])
def test_best_fit_layout_gathers_each_sequence_at_its_segments_shifts(seq_len: int) -> None:
    """`_lay_out` (each document's segment gathered at a fixed shift from its output places, the last of a
    sequence running on over its padding, blocks of `_GATHER_ROWS` sequences) writes what the plain
    scatter of each document to ``sequence * seq_len + offset`` writes: windows of more sequences than
    one block, given as several chunks, whose padding runs past the window's last token; and the
    placement without offsets (what packing and counting use) is the one with them."""
    from raytrain_events.core.packing import _GATHER_ROWS

    rng = np.random.default_rng(seq_len + 11)
    tail = np.maximum(1, rng.lognormal(np.log(seq_len / 6 + 1), 1.2, size=3 * _GATHER_ROWS * 6)).astype(np.int64)
    for lengths in (
        np.minimum(tail, seq_len),  # a long tail over several blocks of sequences
        np.concatenate([np.minimum(tail[:200], seq_len), [seq_len // 2 + 1]]),  # the last document alone, padded
        np.array([0, seq_len, 0]),  # one full sequence between empty documents
    ):
        tokens = rng.integers(1, 30_000, size=int(lengths.sum())).astype(np.int32)
        ids = rng.permutation(len(lengths)).astype(np.int64) * 3 + 1
        fills, seq, offset, placement = _place(lengths, seq_len, "a window")
        got = _place(lengths, seq_len, "a window", offsets=False)
        assert got[0] == fills and np.array_equal(got[1], seq) and got[2] is None and np.array_equal(got[3], placement)
        want = np.full(len(fills) * seq_len, 9, dtype=np.int32)
        starts = np.cumsum(lengths) - lengths
        for i in np.flatnonzero(lengths):
            at = int(seq[i] * seq_len + offset[i])
            want[at : at + int(lengths[i])] = tokens[starts[i] : starts[i] + lengths[i]]
        pieces = np.split(tokens, np.sort(rng.integers(0, len(tokens) + 1, size=3)))  # a Parquet read's chunks
        for given in (tokens, pieces):
            runs = pack_runs(given, lengths, ids, seq_len, "best_fit", pad_id=9)
            assert runs.input_ids.reshape(-1).tolist() == want.tolist()
            assert runs.num_tokens.tolist() == fills and int(runs.runs.sum()) == int(np.count_nonzero(lengths))
