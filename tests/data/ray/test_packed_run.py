"""Packed training through `RayTrainer` end to end: stopped mid-epoch on 2 workers, resumed on 3
(issue 50's done-when).

Two token sources packed separately into sequences of 32 (``web``: 4 files x 3 row groups x 30
documents under ``concat``, in the flat layout `tokenize` writes; ``code``: 3 files x 2 row groups
under ``best_fit``, in the documents layout, packed offline by `pack_tokens` into the packed layout:
the very sequences `PackedTokens` packs from the token files on the fly, checked block by block
before the run) in a two-stage
mixture: each once per epoch (``{"repeat": 1}``, which fixes the epoch's size) until batch 11, then
20/80 %, so ``code`` goes round again and ``web`` stops short. Seed 7 (each source's pack windows
permuted, another permutation on ``code``'s second pass), global batches of 8, the example
transformer with document masks. The first run stops itself after batch 9 (a checkpoint there,
mid-window, in the first stage); the second continues the run by name on 3 workers and crosses the
stage boundary. Checked sequence by sequence: every global batch holds exactly the sequences of the
uninterrupted order (the feeder's stream of the same `MixtureSource` read directly on one rank, the
same at any world size: tests/data/ray/test_packed_source.py), on 2 workers up to the stop and on 3
after, and each batch's sources are the plan's (the stage took effect); the Timestamp's tokens at
the stop and at the end are the real (non-padding) tokens of those sequences, and the per-source
sample and token counts in the final history entry are each source's. The run's batches are the default
``document_ids`` format's, shipped as segments and finished on the device by the loader's
``device_transforms`` (the recorded ``document_ids`` are what the model saw). Per document: a ``code``
document (never split) trained once or twice, each at least once (a source goes round again only
after every sequence was used); a ``web`` document at most once, its tokens in order (its pieces
under concat: a prefix when the stage cut the source short). The same order read with both sources in the
``cu_seqlens`` document format (`PackedTokens(document_format="cu_seqlens")`, through the object store and a
loader, no training run) holds the same sequences with the same document pieces and padding.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import packed_data  # noqa: E402
from packed_data import VOCAB, expected_pieces, pieces_of, write_tokens  # noqa: E402

from tests import resume_helpers as h  # noqa: E402

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray_cloudpickle.register_pickle_by_value(h)
ray_cloudpickle.register_pickle_by_value(packed_data)

SEQ, BATCH, STOP, SEED, SWITCH = 32, 8, 9, 7, 11


class Record(Callback):
    """Each rank appends ``{world, rank, batch, docs, ids}`` per batch; the first run stops after batch ``stop``."""

    def __init__(self, folder: str, stop: int = 0) -> None:
        self.folder, self.stop = folder, stop

    def batch_end(self, state, logger) -> None:
        record = {
            "world": state.world_size,
            "rank": state.rank,
            "batch": int(state.timestamp.batch_in_epoch),
            "docs": state.batch["document_ids"].tolist(),
            "ids": state.batch["input_ids"].tolist(),
        }
        with open(os.path.join(self.folder, f"rows-{os.getpid()}-{state.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.stop and int(state.timestamp.batch) == self.stop:
            state.stop_training("the test's stop", consistent=True)


def _model():
    import torch

    from examples.transformer_lm import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab=VOCAB, width=16, heads=2, depth=1, length=SEQ)


def _sources(folder: str):
    from raytrain_events.data.ray.packed_source import PackedTokens

    web, web_lengths = write_tokens(
        os.path.join(folder, "web"), files=4, groups=3, docs_per_group=30, seed=1, layout="flat"
    )
    code, code_lengths = write_tokens(
        os.path.join(folder, "code"), files=3, groups=2, docs_per_group=30, seed=2, first_id=100_000, longest=SEQ
    )
    from raytrain_events.data.ray.pack_tokens import pack_tokens
    from raytrain_events.data.ray.packed_reads import pack_reads

    packed = os.path.join(folder, "code-packed")
    pack_tokens(code, packed, seq_len=SEQ, policy="best_fit", window_tokens=300, windows_per_shard=2)
    sources = {
        "web": PackedTokens(web, seq_len=SEQ, policy="concat", window_tokens=300, vocab_size=VOCAB),
        "code": PackedTokens(packed, seq_len=SEQ, policy="best_fit", vocab_size=VOCAB),
    }
    on_the_fly = PackedTokens(code, seq_len=SEQ, policy="best_fit", window_tokens=300, vocab_size=VOCAB)
    assert sources["code"].layout == "packed" and len(on_the_fly.windows) > 2
    assert sources["code"].window_sequences == on_the_fly.window_sequences
    for w in range(len(on_the_fly.windows)):
        assert pack_reads([sources["code"].window_args(w)]).equals(pack_reads([on_the_fly.window_args(w)])), w
    return sources, {**web_lengths, **code_lengths}


def _reference(ray, sources, mixture, epoch_size):
    """The uninterrupted order: the feeder's stream of the run's MixtureSource on one rank (a cu_seqlens batch
    as its document ids: each piece's number, `document_attention.with_document_ids`)."""
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.core.mixture_plan import MixtureRun
    from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard
    from raytrain_events.data.ray.mixture_source import MixtureSource
    from raytrain_events.parallel.document_attention import with_document_ids

    source = MixtureSource(sources, MixtureRun(mixture, SEED, epoch_size, BATCH), SEED)
    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, 1, BATCH)
    loader = GlobalOrderLoader(GlobalOrderShard(feeder, 0, 1, BATCH, source.count()), device="cpu")
    loader.set_epoch(0)
    loader.set_position(0)
    rows = []
    spec = DataSpec(loader)  # the loader's own device transforms, as the loop runs them: document_ids from segments
    for batch in map(with_document_ids, map(spec.device_transforms, loader)):
        rows += [(d.tolist(), i.tolist()) for d, i in zip(batch["document_ids"], batch["input_ids"])]
    return rows


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two Ray runs; minutes each on a loaded machine
def test_packed_mixture_stopped_on_2_workers_resumes_on_3_with_the_same_sequences(ray_cluster, tmp_path) -> None:
    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.core.mixture_plan import MixtureRun
    from raytrain_events.data.ray.packed_source import PackedTokens, count_real_tokens

    sources, lengths = _sources(str(tmp_path / "data"))
    counts = {n: s.count() for n, s in sources.items()}
    epoch = sum(counts.values())
    stages = {"0dur": {n: {"repeat": 1} for n in counts}, f"{SWITCH}ba": {"web": 0.2, "code": 0.8}}
    mixture = Mixture(sources=counts, stages=stages)
    reference = _reference(ray_cluster, sources, mixture, epoch)
    assert len(reference) == epoch and epoch > (SWITCH + 2) * BATCH
    # The cu_seqlens format through the object store and the loaders: the same sequences, the same pieces.
    cu = {
        n: PackedTokens(
            s.paths, seq_len=SEQ, policy=s.policy, window_tokens=300, vocab_size=VOCAB, document_format="cu_seqlens"
        )
        for n, s in sources.items()
    }
    cu_rows = _reference(ray_cluster, cu, mixture, epoch)
    assert [i for _, i in cu_rows] == [i for _, i in reference]
    for (docs, _), (pieces, _) in zip(reference, cu_rows):
        d, p = np.asarray(docs), np.asarray(pieces)
        assert np.array_equal(d[1:] != d[:-1], p[1:] != p[:-1]) and np.array_equal(d < 0, p < 0)
    records = str(tmp_path / "records")
    os.makedirs(records)
    checkpoint = CheckpointConfig(save_interval=f"{STOP}ba", keep=1, save_every_n_seconds=None, autoresume=True)
    results = []
    for attempt, workers in enumerate((2, 3)):
        results.append(
            RayTrainer(
                model=_model,
                optimizers=lambda model: __import__("torch").optim.AdamW(model.parameters(), lr=1e-3),
                datasets=sources,
                mixture=mixture,
                batch_size=999,  # ignored: global_batch_size fixes the sequences per step
                global_batch_size=BATCH,
                get_num_tokens_in_batch=count_real_tokens,
                max_duration="1ep",
                seed=SEED,
                num_workers=workers,
                storage_path=str(tmp_path / "runs"),
                run_name="packed",
                checkpoint=checkpoint,
                report_interval=f"{STOP}ba",
                callbacks=[Record(records, stop=STOP if attempt == 0 else 0)],
            ).fit()
        )

    def real(rows):
        return sum(int((np.asarray(d) >= 0).sum()) for d, _ in rows)

    batches = -(-epoch // BATCH)
    assert h.timestamp_of(results[0]) == {
        "epoch": 0,
        "batch": STOP,
        "sample": STOP * BATCH,
        "token": real(reference[: STOP * BATCH]),
    }
    assert h.timestamp_of(results[1]) == {"epoch": 1, "batch": batches, "sample": epoch, "token": real(reference)}
    by_batch = {}
    for path in os.listdir(records):
        with open(os.path.join(records, path)) as f:
            for line in f:
                r = json.loads(line)
                by_batch.setdefault(r["batch"], []).append(r)
    assert sorted(by_batch) == list(range(1, batches + 1))
    trained = []
    for b, rs in sorted(by_batch.items()):
        assert {r["world"] for r in rs} == {2 if b <= STOP else 3} and len(rs) == rs[0]["world"], b
        rows = [(d, i) for r in sorted(rs, key=lambda r: r["rank"]) for d, i in zip(r["docs"], r["ids"])]
        assert rows == reference[(b - 1) * BATCH : b * BATCH], b  # sequence by sequence
        trained += rows
    code_rows = [[max(d) >= 100_000 for d, _ in reference[a : a + BATCH]] for a in range(0, epoch, BATCH)]
    plan = MixtureRun(mixture, SEED, epoch, BATCH).plan()
    code = mixture.names.index("code")
    for k, a in enumerate(range(0, epoch, BATCH)):  # each batch's sources are the staged plan's
        planned = plan.batch_sources(0, a, min(a + BATCH, epoch), a, BATCH)
        assert sum(code_rows[k]) == sum(1 for s in planned if s == code), k
    assert sum(map(sum, code_rows[SWITCH:])) > 0.7 * sum(map(len, code_rows[SWITCH:]))  # the second stage: 80 %
    pieces = pieces_of([{"document_ids": [d for d, _ in trained], "input_ids": [i for _, i in trained]}])
    want = expected_pieces(lengths)
    for doc, tokens in pieces.items():
        if doc >= 100_000:  # code, best_fit: whole documents, once or on the second pass again
            assert tokens in (want[doc], want[doc] * 2), doc
        else:  # web, concat: each piece once, in order (a prefix where the stage cut the source short)
            assert tokens == want[doc][: len(tokens)], doc
    assert {d for d in want if d >= 100_000} <= set(pieces)
    assert any(len(t) == 2 * len(want[d]) for d, t in pieces.items() if d >= 100_000)  # code went round again
    assert {d for d in want if d < 100_000} - set(pieces)  # and web stopped short
    final = results[1].metrics
    web_rows = [r for r in reference if max(r[0]) < 100_000]
    code_rows_all = [r for r in reference if max(r[0]) >= 100_000]
    assert {n: final[f"mixture/tokens/{n}"] for n in counts} == {"web": real(web_rows), "code": real(code_rows_all)}
    assert {n: final[f"mixture/samples/{n}"] for n in counts} == {"web": len(web_rows), "code": len(code_rows_all)}
