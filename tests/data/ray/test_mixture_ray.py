"""`RayTrainer(mixture=...)`'s data path on the session's Ray, through the feeder and the workers' loaders.

Three Parquet sources (ids 0-399, 1000-1149, 2000-2089, 3 rows of tokens each id's last digit + 1)
mixed in two stages ('0sp': 0.5/0.3/0.2, '200sp': 0.2/0.3/0.5; 'code' asked for more than it holds in
the second stage's share of a 2-epoch run, so it goes round). The `MixtureSource` through one
`EpochFeeder` and the `MixtureOrderLoader` of each rank: 2 ranks from the start, and 3 ranks resumed
at a position inside the second stage, give the same global batches as the plan (each position's
source, every chosen row of a source once per pass), the per-source counts of each batch match the
rows' own ids and tokens, and the resumed epoch's read tasks open no row group before any source's
cursor (a logging filesystem, as tests/data/ray/test_parquet_seek.py).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Dict, List

import pytest
from pyarrow import fs as pafs
from ray import cloudpickle as ray_cloudpickle

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_parquet_seek import CountingHandler  # noqa: E402

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCES = {"web": (0, 400), "code": (1000, 150), "math": (2000, 90)}  # name -> (first id, rows)
GROUP_ROWS = 10
STAGES = {"0sp": {"web": 0.5, "code": 0.3, "math": 0.2}, "200sp": {"web": 0.2, "code": 0.3, "math": 0.5}}


def write_sources(folder: str) -> Dict[str, List[str]]:
    """Each source as 2 Parquet files of row groups of 10 rows: ``id``, ``tokens`` (3 int32), ``ntok``, ``label``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths: Dict[str, List[str]] = {}
    for name, (first, rows) in SOURCES.items():
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        ids = list(range(first, first + rows))
        half = rows // 2
        paths[name] = []
        for part, chunk in enumerate((ids[:half], ids[half:])):
            path = os.path.join(folder, name, f"part-{part}.parquet")
            table = pa.table(
                {
                    "id": pa.array(chunk, pa.int64()),
                    "tokens": pa.array([[i % 7] * 3 for i in chunk], pa.list_(pa.int32(), 3)),
                    "ntok": pa.array([i % 10 + 1 for i in chunk], pa.int64()),
                    "label": pa.array([i % 2 for i in chunk], pa.int64()),
                }
            )
            pq.write_table(table, path, row_group_size=GROUP_ROWS)
            paths[name].append(path)
    return paths


def source_of(row_id: int) -> str:
    return next(name for name, (first, rows) in SOURCES.items() if first <= row_id < first + rows)


def mixture() -> Mixture:
    return Mixture(sources={n: rows for n, (_, rows) in SOURCES.items()}, stages=STAGES)


def _loaders(ray, train, world: int, global_batch: int):
    from raytrain_events.data.ray.loader import GlobalOrderShard
    from raytrain_events.data.ray.mixture_loader import MixtureOrderLoader

    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(None, world, global_batch)
    source = [ray.put(train)]
    count = lambda batch: int(batch["ntok"].sum())  # noqa: E731
    return [
        MixtureOrderLoader(
            GlobalOrderShard(feeder, r, world, global_batch, train.count(), source=source, mixture=train.run),
            device="cpu",
            tokens_of_batch=count,
        )
        for r in range(world)
    ]


def _epoch(loaders, epoch: int, position: int):
    """(global batches of ids, per-source samples and tokens the loaders counted) from ``position``."""
    for loader in loaders:
        loader.set_epoch(epoch)
        loader.set_position(position)
    batches, samples, tokens = [], Counter(), Counter()
    names = loaders[0].mixture.names
    for per_rank in zip(*loaders, strict=True):
        batches.append([i for batch in per_rank for i in batch["id"].tolist()])
        for loader, batch in zip(loaders, per_rank):
            assert batch["tokens"].shape[1] == 3
            # Each row's source and some rows' tokens (what SpikeGuard's quarantine counts a dropped row by).
            facts, ids = loader.batch_facts(), batch["id"].tolist()
            assert [names[s] for s in loader.sources_of(facts)] == [source_of(i) for i in ids]
            odd = list(range(1, len(ids), 2))
            assert loader.tokens_of_rows(batch, odd, facts) == sum(int(batch["ntok"][i]) for i in odd)
            for name, s, t in zip(names, loader.batch_samples, loader.batch_tokens):
                samples[name] += s
                tokens[name] += t
    return batches, samples, tokens


@pytest.mark.ray
def test_a_mixture_resumed_on_another_world_size_reads_nothing_before_its_cursors(ray_cluster, tmp_path) -> None:
    from raytrain_events.data.ray.mixture_source import MixtureSource, mixture_train_set
    from raytrain_events.ray.plan import mixture_run

    ray = ray_cluster
    paths = write_sources(str(tmp_path / "data"))
    log = str(tmp_path / "opened.log")
    fs = pafs.PyFileSystem(CountingHandler(log))
    datasets = {name: ParquetRowGroups(p, filesystem=fs) for name, p in paths.items()}

    class Spec:  # the RunSpec fields the driver's step reads (its sections: ray/spec_sections.py)
        seed, max_duration = 5, None

        class data:
            mixture, shuffle_buffer_size, batch_size, global_batch_size = mixture().to_dict(), None, 8, 24

        class scaling:
            workers = 2

        class parallelism_spec:
            batch_group = 1

    train = mixture_train_set(Spec, datasets, mixture_run(Spec))["train"]
    assert isinstance(train, MixtureSource) and train.count() == 640
    plan = train.plan
    # Epoch 1, from the start on 2 ranks: each global batch the plan's positions, listed by source; rows once per pass.
    full, samples, tokens = _epoch(_loaders(ray, train, 2, 24), 1, 0)
    ids = [i for batch in full for i in batch]
    assert len(ids) == 640 and [len(b) for b in full] == [24] * 26 + [16]
    assert [plan.mixture.names.index(source_of(i)) for i in ids] == plan.batch_sources(1, 0, 640, 0, 24)
    for k, batch in enumerate(full):  # the same sources in each global batch as the plan's positions
        lo = 24 * k
        assert Counter(plan.mixture.names.index(source_of(i)) for i in batch) == Counter(plan.sources(1, lo, lo + 24))
    totals = dict(zip(plan.mixture.names, plan.epoch_totals(1)))
    assert dict(samples) == totals == {n: Counter(map(source_of, ids))[n] for n in plan.mixture.names}
    assert dict(tokens) == {n: sum(i % 10 + 1 for i in ids if source_of(i) == n) for n in plan.mixture.names}
    for name, (_, rows) in SOURCES.items():  # each pass over a source trains each of its rows once
        taken = [i for i in ids if source_of(i) == name]
        for p in range(0, len(taken), rows):
            chunk = taken[p : p + rows]
            assert len(set(chunk)) == len(chunk), name
    assert Counter(map(source_of, ids))["code"] > 150  # code went round: a second pass, in another order
    # The same epoch resumed at position 336 (inside the second stage) on 3 ranks: the same global batches.
    position = 336
    os.remove(log)
    resumed, _, _ = _epoch(_loaders(ray, train, 3, 24), 1, position)
    assert [sorted(b) for b in resumed] == [sorted(b) for b in full[position // 24 :]]
    # Without a seed each source's order is its files' order, so the resumed reads can be named: each
    # source's first read task opens the files from the one holding its cursor on, and a later pass all of
    # them; nothing before any source's cursor is opened (the footers were read here, where it was built).
    Spec.seed = None
    train = mixture_train_set(Spec, datasets, mixture_run(Spec))["train"]
    plan = train.plan
    os.remove(log)
    resumed, _, _ = _epoch(_loaders(ray, train, 3, 24), 1, position)
    taken = list(plan.cursors(1, position))
    expected = []
    for s in plan.batch_sources(1, position, 640, position, 24):  # unseeded: a source's t-th row is its row t % rows
        first, rows = SOURCES[plan.mixture.names[s]]
        expected.append(first + taken[s] % rows)
        taken[s] += 1
    assert [i for batch in resumed for i in batch] == expected
    opened = Counter()
    with open(log) as f:
        for line in f:
            path, pid = line.split()
            if int(pid) != os.getpid():
                opened[(os.path.basename(os.path.dirname(path)), os.path.basename(path))] += 1
    want = Counter()
    totals = dict(zip(plan.mixture.names, plan.epoch_totals(1)))
    for name, cursor in zip(plan.mixture.names, plan.cursors(1, position)):
        rows = SOURCES[name][1]
        for pass_ in range(cursor // rows, (totals[name] - 1) // rows + 1):
            start = cursor % rows if pass_ == cursor // rows else 0
            for part in range(start // (rows // 2), 2):  # one read task per pass (the files are small)
                want[(name, f"part-{part}.parquet")] += 1
    assert opened == want
    assert any(
        cursor % SOURCES[n][1] >= SOURCES[n][1] // 2 for n, cursor in zip(plan.mixture.names, plan.cursors(1, position))
    )


def test_a_bad_mixture_source_is_refused_naming_the_fix(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.mixture_source import check_mixture

    paths = write_sources(str(tmp_path / "data"))
    datasets = {name: ParquetRowGroups(p) for name, p in paths.items()}
    good = mixture().to_dict()
    with pytest.raises(MixtureError, match=r"\['math'\] are not in datasets"):
        check_mixture(good, {k: v for k, v in datasets.items() if k != "math"}, None)
    with pytest.raises(MixtureError, match=r"give Mixture\(sources=\{'code': 150, 'math': 90, 'web': 400\}"):
        check_mixture({**good, "sources": {**good["sources"], "web": 399}}, datasets, None)
    with pytest.raises(ValueError, match="leave 'train' out"):
        check_mixture(good, {**datasets, "train": datasets["web"]}, None)
    with pytest.raises(ValueError, match="Leave shuffle_buffer_size unset"):
        check_mixture(good, datasets, 100)
    other = str(tmp_path / "other.parquet")
    pq.write_table(pa.table({"id": list(range(90)), "tokens": [[1, 2]] * 90, "ntok": [1] * 90}), other)
    with pytest.raises(MixtureError, match="'math' has another schema than 'code'.*convert it first"):
        check_mixture(good, {**datasets, "math": ParquetRowGroups(other)}, None)


@pytest.mark.parametrize("global_batch,world,position", [(96, 3, 0), (100, 7, 12_345), (5_000, 4, 0), (64, 2, 23_990)])
def test_a_ranks_plan_window_names_each_batchs_sources_as_a_walk_per_batch(global_batch, world, position) -> None:
    """`MixtureOrderLoader` walks the plan once per several small global batches (`_PLAN_WINDOW`): each
    batch's per-source counts are still those of its own positions, across a stage change and epochs."""
    from types import SimpleNamespace

    from raytrain_events.core.mixture import Mixture
    from raytrain_events.data.ray.mixture_loader import MixtureOrderLoader

    mixture = Mixture(
        sources={"web": 12_000, "code": 7_000, "math": 5_000},
        stages={"0dur": {"web": 0.5, "code": 0.3, "math": 0.2}, "0.5dur": {"web": 0.2, "code": 0.4, "math": 0.4}},
    )
    plan = mixture.plan(seed=0, total_samples=48_000, global_batch=global_batch)
    loader = object.__new__(MixtureOrderLoader)  # only the plan and the shard's cut: no feeder
    loader.plan, loader._window, loader._anchor = plan, (-1, 0, []), position
    loader.shard = SimpleNamespace(global_batch=global_batch, data_world_size=world, rank=world - 1, tensor_parallel=1)
    for epoch in (0, 1):
        for k in range(-(-(plan.epoch_size - position) // global_batch)):
            a, b = loader._rank_positions(position, k)
            assert loader._sources(epoch, a, b) == plan.batch_sources(epoch, a, b, position, global_batch), (epoch, k)
