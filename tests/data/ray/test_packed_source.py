"""`PackedTokens` through the feeder and the loaders (the session's Ray; no Ray Train run).

Token Parquet of 6 files x 3 row groups x 40 documents (a long-tail length mix, a few empty),
packed into sequences of 48 in windows of about 500 tokens. An epoch on 2 ranks trains every
document's tokens once (every piece once under ``concat``); the same epoch entered at a
position inside a window on 3 ranks trains exactly the sequences from there on, and opens no file
wholly before the window holding the position; with a seed the windows are permuted (and with the row
shuffle, sequences within shuffle windows), the same way at any world size. Files without ``document_id``/``num_tokens`` columns pack to the same sequences
(document ids are then row numbers). A feeder killed mid-epoch rebuilds the packed stream mid-window
and the ranks train the uninterrupted epoch's sequences. Bad input is refused where the source is built, before any
training: a document longer than ``seq_len`` under best_fit, token ids (from the footers'
statistics) or a tokenizer vocabulary larger than the model's ``vocab_size``, a column that is not
a list of token ids.
"""

from __future__ import annotations

import os
import sys
from typing import List

import numpy as np
import pytest
import torch
from pyarrow import fs as pafs
from ray import cloudpickle as ray_cloudpickle

from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
from raytrain_events.data.ray.packed_source import PackedTokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packed_data import VOCAB, expected_pieces, pieces_of, write_tokens  # noqa: E402
from test_parquet_seek import CountingHandler  # noqa: E402

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
SEQ, WINDOW, BATCH = 48, 500, 8


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("packed"))
    paths, lengths = write_tokens(os.path.join(folder, "a"), files=6, groups=3, docs_per_group=40, seed=0)
    bare, _ = write_tokens(os.path.join(folder, "b"), files=6, groups=3, docs_per_group=40, seed=0, with_columns=False)
    return paths, bare, lengths


def _epoch(ray, source, world: int, position: int, seed=None, shuffle_rows=None) -> List[dict]:
    from raytrain_events.data.order import TrainOrder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, world, BATCH)
    loaders = [
        GlobalOrderLoader(
            GlobalOrderShard(feeder, r, world, BATCH, source.count(), order=TrainOrder(seed, shuffle_rows)),
            device="cpu",
        )
        for r in range(world)
    ]
    for loader in loaders:
        loader.set_epoch(0)
        loader.set_position(position)
    rows: List[dict] = []
    for per_rank in zip(*map(_finished, loaders), strict=True):
        for batch in per_rank:
            rows += [{k: v[i].clone() for k, v in batch.items()} for i in range(len(batch["num_tokens"]))]
    return rows


def _finished(loader):
    """The loader's batches as the loop hands them to the model: moved, then its `DataSpec`'s device transforms
    (the loader's own first: a packed batch's ``document_ids``/``position_ids`` made from its segments)."""
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.trainer._batch import device_batches

    return device_batches(DataSpec(loader), torch.device("cpu"))


def _same(a: List[dict], b: List[dict]) -> bool:
    return len(a) == len(b) and all(all(bool((x[k] == y[k]).all()) for k in x) for x, y in zip(a, b))


@pytest.mark.ray
@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_an_epoch_trains_every_document_once_and_a_resume_mid_window_continues_it(
    ray_cluster, tokens, tmp_path, policy
) -> None:
    ray = ray_cluster
    paths, bare, lengths = tokens
    log = str(tmp_path / "opened.log")
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    source = PackedTokens(
        ParquetRowGroups(paths, filesystem=pafs.PyFileSystem(CountingHandler(log))),
        seq_len=SEQ,
        policy=policy,
        window_tokens=WINDOW,
        vocab_size=VOCAB,
    )
    os.remove(log)  # the footers and lengths, read once where the source is built
    assert len(source.windows) > 6 and source.real_tokens == sum(lengths.values())
    full = _epoch(ray, source, 2, 0)
    assert len(full) == source.count()
    assert sum(int(r["num_tokens"]) for r in full) == sum(lengths.values())
    assert pieces_of(
        [
            {
                "document_ids": np.stack([r["document_ids"] for r in full]),
                "input_ids": np.stack([r["input_ids"] for r in full]),
            }
        ]
    ) == expected_pieces(lengths)
    # Resumed inside the window that starts file 3's first row group, on 3 ranks: the same sequences from there.
    window = next(w for w, (a, _) in enumerate(source.windows) if source.units[a] >= (3, 0))
    position = sum(source.window_sequences[:window]) + 2
    os.remove(log)
    assert _same(_epoch(ray, source, 3, position), full[position:])
    with open(log) as f:
        opened = {os.path.basename(line.split()[0]) for line in f}
    assert not opened & {"part-00.parquet", "part-01.parquet", "part-02.parquet"}, opened
    # Files without document_id / num_tokens: the same sequences (ids are then row numbers, here the same).
    assert _same(_epoch(ray, PackedTokens(bare, seq_len=SEQ, policy=policy, window_tokens=WINDOW), 2, 0), full)


@pytest.mark.ray
def test_a_seeded_order_permutes_windows_the_same_at_any_world_size(ray_cluster, tokens) -> None:
    ray = ray_cluster
    source = PackedTokens(tokens[0], seq_len=SEQ, window_tokens=WINDOW)
    full = _epoch(ray, source, 2, 0, seed=3)
    plain = _epoch(ray, source, 2, 0)
    assert not _same(full, plain) and sorted(int(r["document_ids"][0]) for r in full) == sorted(
        int(r["document_ids"][0]) for r in plain
    )
    assert _same(_epoch(ray, source, 3, 37, seed=3), full[37:])
    # With the row shuffle (sequences permuted within windows of 30+ sequences): the same order resumed.
    shuffled = _epoch(ray, source, 2, 0, seed=3, shuffle_rows=30)
    assert not _same(shuffled, full) and _same(_epoch(ray, source, 3, 45, seed=3, shuffle_rows=30), shuffled[45:])


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_blocks_carry_runs_and_a_rank_expands_any_cut_of_them_to_the_batch_columns(tokens, policy: str) -> None:
    """A read task's block holds tokens plus each sequence's documents as runs (a quarter of the
    batch's bytes and a little); any rows of one or two blocks expand (as the loader does) to exactly
    those rows of `pack_window`'s sequences: the same ``document_ids``/``position_ids`` as ever."""
    import pyarrow as pa

    from raytrain_events.core.packing import expand_runs
    from raytrain_events.data.ray.batch_tensors import table_to_torch
    from raytrain_events.data.ray.packed_batch import SEGMENT_COLUMNS, expand_batch, expand_packed, packed_tensors
    from raytrain_events.data.ray.packed_reads import pack_read, pack_reads

    source = PackedTokens(tokens[0], seq_len=SEQ, policy=policy, window_tokens=WINDOW)
    groups = [[source.window_args(w) for w in ws] for ws in ([0, 1], [2, 3, 4])]
    blocks = [pack_reads(g) for g in groups]
    whole = [pa.concat_tables([pack_read(**a) for a in g]) for g in groups]  # each window packed on its own
    assert set(blocks[0].column_names) == {"input_ids", "num_tokens", "run_documents", "run_lengths"}
    assert blocks[0].nbytes < whole[0].nbytes / 2
    n0, n1 = blocks[0].num_rows, blocks[1].num_rows
    for (a, b), (c, d) in (((0, n0), (0, 0)), ((3, n0), (0, 5)), ((n0 - 1, n0), (2, n1 - 1))):
        parts = [blocks[0].slice(a, b - a)] + ([blocks[1].slice(c, d - c)] if d > c else [])
        (got,) = expand_packed(parts)
        want = pa.concat_tables([whole[0].slice(a, b - a), whole[1].slice(c, d - c)])
        assert got.column_names == want.column_names
        for name in want.column_names:
            assert got.column(name).to_pylist() == want.column(name).to_pylist(), (name, a, b, c, d)
        expected = table_to_torch(got)
        segments = packed_tensors(parts, expand=False)  # the loader's: segments, finished on the device
        assert list(segments) == ["input_ids", *SEGMENT_COLUMNS, "num_tokens"]
        runs = sum(len(r) for p in parts for r in p.column("run_lengths").to_pylist())
        assert len(segments["segment_lengths"]) <= runs + (b - a) + (d - c)  # O(runs + rows): nothing per token
        for tensors in (packed_tensors(parts), expand_batch(segments)):  # on the host; from the segments
            assert list(tensors) == list(expected) == want.column_names
            for name, tensor in expected.items():
                assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), (name, a, b, c, d)
    plain = pa.table({"x": [1, 2]})
    assert expand_packed([plain]) == [plain] and packed_tensors([plain]) is None  # anything else passes through
    with pytest.raises(ValueError, match="do not tile .* a corrupt packed block"):
        expand_runs(np.array([5]), np.array([SEQ + 1]), np.array([1]), np.array([SEQ]), SEQ)


def _two_block_cut(source):
    """A batch's slices across two packed blocks of ``source`` (the last 3 rows of one, rows 1-5 of the next)."""
    from raytrain_events.data.ray.packed_reads import pack_reads
    from raytrain_events.data.ray.slices import RowRange

    a, b = (pack_reads([source.window_args(w) for w in ws]) for ws in ([0, 1], [2, 3]))
    slices, blocks = [RowRange("a", a.num_rows - 3, a.num_rows), RowRange("b", 1, 6)], {"a": (a, None), "b": (b, None)}
    return slices, blocks, [a.slice(a.num_rows - 3, 3), b.slice(1, 5)]


def test_the_loader_ships_segments_and_its_data_spec_finishes_them_to_the_expanded_tensors(tokens) -> None:
    """The loader's own `_to_batch` (no Ray needed): a batch spanning two packed blocks comes out as its
    segments (O(runs + rows) numbers, no per-token ids), and the loader's ``device_transforms``, which
    `DataSpec` runs before the user's own, makes it `table_to_torch` of the expanded table (the same keys,
    order, dtypes and values); a replica group's cut of it by rows (`ReplicaLoader`) finishes to those rows;
    ``columns`` picks after that (a missing one is refused naming the columns); with ``collate_fn`` the
    expanded columns reach it as NumPy (expanded on the host: it reads them)."""
    import pyarrow as pa

    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.data.ray.batch_tensors import table_to_torch
    from raytrain_events.data.ray.loader import GlobalOrderLoader
    from raytrain_events.data.ray.packed_batch import SEGMENT_COLUMNS, expand_packed

    source = PackedTokens(tokens[0], seq_len=SEQ, policy="best_fit", window_tokens=WINDOW)
    slices, blocks, parts = _two_block_cut(source)
    (table,) = expand_packed(parts)
    want = table_to_torch(pa.concat_tables([table]))
    loader = GlobalOrderLoader(None, device="cpu")
    shipped = loader._to_batch(slices, blocks)
    assert list(shipped) == ["input_ids", *SEGMENT_COLUMNS, "num_tokens"] and shipped["input_ids"] is not None
    seen = []
    spec = DataSpec(loader, device_transforms=lambda batch: seen.append(list(batch)) or {**batch, "mine": 1})
    got = spec.device_transforms(shipped)
    assert seen == [list(want)] and got.pop("mine") == 1  # the user's transform got the finished batch
    assert list(got) == list(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert DataSpec(loader).device_transforms(want) is want  # a finished (or any other) batch passes as it is
    from raytrain_events.core.replica_layout import part_rows
    from raytrain_events.ray.replica_loader import _cut

    for part in range(3):  # replica groups cut a global batch by rows: a packed one's segments go with its rows
        lo, hi = part_rows(8, part, 3)
        cut = loader.device_transforms(_cut(shipped, part, 3))
        assert list(cut) == list(want) and all(torch.equal(cut[k], want[k][lo:hi]) for k in want), part
    picking = GlobalOrderLoader(None, device="cpu", columns=["num_tokens", "document_ids"])
    picked = DataSpec(picking).device_transforms(picking._to_batch(slices, blocks))
    assert list(picked) == ["num_tokens", "document_ids"] and torch.equal(picked["document_ids"], want["document_ids"])
    wrong = GlobalOrderLoader(None, device="cpu", columns=["labels"])
    with pytest.raises(KeyError, match="no column.*'labels'"):
        DataSpec(wrong).device_transforms(wrong._to_batch(slices, blocks))
    seen = GlobalOrderLoader(None, device="cpu", collate_fn=lambda batch: batch)._to_batch(slices, blocks)
    assert sorted(seen) == sorted(want) and np.array_equal(np.stack(seen["document_ids"]), want["document_ids"].numpy())


def test_the_trainer_trains_on_the_batches_a_host_expansion_gave(tokens) -> None:
    """The local `Trainer` over a loader shaped as the Ray train loader (`GlobalOrderLoader._to_batch` of cuts
    of packed blocks, no feeder; `RayTrainer`'s workers wrap theirs in a `DataSpec` alike): what callbacks see
    at ``AFTER_DATALOADER`` (and the model trains on, in microbatches: ``grad_accum=2``) is the batch the host
    used to expand (`packed_tensors`: the same keys, dtypes and values), the user's own ``device_transforms``
    gets that very batch, and the Timestamp counts its real tokens (`count_real_tokens`)."""
    from examples.transformer_lm import TransformerLM
    from raytrain_events import Callback, Trainer
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.data.ray.loader import GlobalOrderLoader
    from raytrain_events.data.ray.packed_batch import packed_tensors
    from raytrain_events.data.ray.packed_reads import pack_reads
    from raytrain_events.data.ray.packed_source import count_real_tokens
    from raytrain_events.data.ray.slices import RowRange

    source = PackedTokens(tokens[0], seq_len=SEQ, policy="best_fit", window_tokens=WINDOW)
    block = pack_reads([source.window_args(w) for w in range(3)])
    cuts = [(0, 3), (3, 7), (block.num_rows - 3, block.num_rows)]
    assert int(packed_tensors([block.slice(*cuts[-1])])["num_tokens"].min()) < SEQ  # padding among them

    class Loader(GlobalOrderLoader):  # the Ray loader's batches, without the feeder
        def __iter__(self):
            return (self._to_batch([RowRange("a", a, b)], {"a": (block, None)}) for a, b in cuts)

        def __len__(self) -> int:
            return len(cuts)

    class Seen(Callback):
        batches: List[dict] = []

        def after_dataloader(self, state, logger) -> None:
            self.batches.append(state.batch)

    torch.manual_seed(0)
    net = TransformerLM(vocab=VOCAB, width=16, heads=2, depth=1, length=SEQ)
    mine: List[dict] = []
    spec = DataSpec(
        Loader(None, device="cpu"),
        get_num_tokens_in_batch=count_real_tokens,
        device_transforms=lambda batch: mine.append(batch) or batch,
    )
    trainer = Trainer(
        model=net,
        train_dataloader=spec,
        max_duration=f"{len(cuts)}ba",
        optimizers=torch.optim.SGD(net.parameters(), lr=1e-2),
        grad_accum=2,
        callbacks=[Seen()],
    )
    trainer.fit()
    expanded = [packed_tensors([block.slice(a, b - a)]) for a, b in cuts]  # the host's expansion, as before
    assert [m is b for m, b in zip(mine, Seen.batches, strict=True)] == [True] * len(cuts)
    for got, want in zip(Seen.batches, expanded, strict=True):
        assert list(got) == list(want) == ["input_ids", "document_ids", "position_ids", "num_tokens"]
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert int(trainer.state.timestamp.token) == sum(int(b["num_tokens"].sum()) for b in expanded)
    trainer.close()


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
def test_cu_seqlens_batches_carry_the_same_documents_and_train_the_same_model(tokens, policy: str) -> None:
    """``document_format="cu_seqlens"``: the loader's batch of a cut across two blocks carries the same tokens and
    real-token counts, and instead of per-token ids the batch's pieces (padding one more) as flash-attn's
    ``cu_seqlens`` over its rows end to end; the table form (collate_fn) holds each row's own. The built-in
    transformer trained three steps from either format gives identical logits and losses."""
    from examples.transformer_lm import TransformerLM
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.data.ray.loader import GlobalOrderLoader
    from raytrain_events.data.ray.packed_source import count_real_tokens
    from raytrain_events.parallel.document_attention import cu_seqlens_to_ids

    batches = {}
    for fmt in ("document_ids", "cu_seqlens"):
        source = PackedTokens(tokens[0], seq_len=SEQ, policy=policy, window_tokens=WINDOW, document_format=fmt)
        slices, blocks, _ = _two_block_cut(source)
        loader = GlobalOrderLoader(None, device="cpu")
        batches[fmt] = DataSpec(loader).device_transforms(loader._to_batch(slices, blocks))  # as the loop has it
        table = GlobalOrderLoader(None, device="cpu", collate_fn=lambda batch: batch)._to_batch(slices, blocks)
    ids, cu = batches["document_ids"], batches["cu_seqlens"]
    assert list(cu) == ["input_ids", "cu_seqlens", "max_seqlen", "num_tokens"] and cu["cu_seqlens"].dtype == torch.int32
    assert torch.equal(ids["input_ids"], cu["input_ids"]) and torch.equal(ids["num_tokens"], cu["num_tokens"])
    assert count_real_tokens(ids) == count_real_tokens(cu) and int(cu["cu_seqlens"][-1]) == 8 * SEQ
    pieces = torch.diff(cu["cu_seqlens"])
    assert int(cu["max_seqlen"]) == int(pieces.max()) and int(pieces.min()) > 0
    docs, positions = cu_seqlens_to_ids(cu["cu_seqlens"], cu["num_tokens"])
    assert torch.equal(positions, ids["position_ids"]) and torch.equal(docs < 0, ids["document_ids"] < 0)
    changes = lambda d: d[:, 1:] != d[:, :-1]  # noqa: E731 (a piece starts where the id changes)
    assert torch.equal(changes(docs), changes(ids["document_ids"]))
    rows = [np.asarray(r) for r in table["cu_seqlens"]]  # collate_fn: each row's own, 0 .. SEQ
    assert all(r[0] == 0 and r[-1] == SEQ for r in rows)
    laid = np.concatenate([rows[0]] + [r[1:] + i * SEQ for i, r in enumerate(rows) if i])
    assert np.array_equal(laid, cu["cu_seqlens"].numpy())
    from raytrain_events.core.data_spec import default_split_batch
    from raytrain_events.ray.replica_loader import _cut

    # microbatches (rows 3, 3, 2), and replica groups' parts of a global batch (the same rows)
    cuts = [*zip(default_split_batch(cu, 3), default_split_batch(ids, 3))]
    cuts += [(_cut(cu, i, 3), _cut(ids, i, 3)) for i in range(3)]
    for part, want in cuts:
        assert (
            torch.equal(part["input_ids"], want["input_ids"])
            and int(part["cu_seqlens"][-1]) == part["input_ids"].numel()
        )
        got_docs, got_positions = cu_seqlens_to_ids(part["cu_seqlens"], part["num_tokens"])
        assert torch.equal(got_positions, want["position_ids"]) and torch.equal(
            changes(got_docs), changes(want["document_ids"])
        )
        assert int(part["max_seqlen"]) == int(torch.diff(part["cu_seqlens"]).max())
    losses = {}
    for fmt, batch in batches.items():
        torch.manual_seed(0)
        net = TransformerLM(vocab=VOCAB, width=16, heads=2, depth=1, length=SEQ)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        losses[fmt] = []
        for _ in range(3):
            logits = net(batch)
            loss = net.loss(logits, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[fmt].append((logits.detach(), loss.item()))
    for (l1, v1), (l2, v2) in zip(losses["document_ids"], losses["cu_seqlens"]):
        assert torch.equal(l1, l2) and v1 == v2
    with pytest.raises(ValueError, match="document_format='flat'"):
        PackedTokens(tokens[0], seq_len=SEQ, document_format="flat")


def test_bad_input_is_refused_where_the_source_is_built(tokens, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.core.packing import PackingError

    paths, _, lengths = tokens
    with pytest.raises(PackingError, match=r"more than seq_len=16, and policy='best_fit' never splits.*Fix"):
        PackedTokens(paths, seq_len=16, policy="best_fit")
    assert PackedTokens(paths, seq_len=16, policy="concat").real_tokens == sum(lengths.values())
    with pytest.raises(ValueError, match=r"token ids 1\.\.\d+ are outside the model's vocabulary \[0, 100\)"):
        PackedTokens(paths, seq_len=SEQ, vocab_size=100)
    text = str(tmp_path / "text.parquet")
    pq.write_table(pa.table({"input_ids": ["a document", "another"]}), text)
    with pytest.raises(TypeError, match="is string, not a list of integer token ids.*raytrain-events tokenize"):
        PackedTokens(text, seq_len=SEQ)
    with pytest.raises(ValueError, match="have no 'tokens' column"):
        PackedTokens(paths, seq_len=SEQ, tokens_column="tokens")
    wide = str(tmp_path / "wide.parquet")
    table = pa.table({"input_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32()))})
    pq.write_table(table.replace_schema_metadata({b"raytrain_events.vocab_size": b"50000"}), wide)
    with pytest.raises(ValueError, match="tokenized with a vocabulary of 50000 tokens, more than vocab_size=4096"):
        PackedTokens(wide, seq_len=SEQ, vocab_size=VOCAB)


@pytest.mark.ray
def test_a_feeder_killed_mid_pack_rebuilds_the_same_sequences(ray_cluster, tokens) -> None:
    """The feeder dies after batch 60 of about 80 (global batches of 2 sequences): the restarted one
    rebuilds the epoch from batch 20 on (its restart slack), entering the packed stream mid-window;
    the ranks train exactly the uninterrupted epoch's sequences."""
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    ray = ray_cluster
    source = PackedTokens(tokens[0], seq_len=SEQ, window_tokens=WINDOW)
    world, batch = 2, 2
    assert source.count() > 70 * batch
    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(None, world, batch)
    refs = [ray.put(source)]
    loaders = [
        GlobalOrderLoader(GlobalOrderShard(feeder, r, world, batch, source.count(), source=refs), device="cpu")
        for r in range(world)
    ]
    for loader in loaders:
        loader.set_epoch(0)
    rows: List[dict] = []
    for k, per_rank in enumerate(zip(*map(_finished, loaders), strict=True)):
        for b in per_rank:
            rows += [{key: v[i].clone() for key, v in b.items()} for i in range(len(b["num_tokens"]))]
        if k == 60:
            ray.kill(feeder, no_restart=False)  # the process dies; Ray restarts the actor
    reference = _epoch(ray, source, 2, 0)
    assert _same(rows, reference)
