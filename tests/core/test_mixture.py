"""`Mixture` and its plan: validation, plain data, and the plan's properties (hypothesis)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_plan import LEAF, permute

SOURCES = {"web": 300, "code": 120, "math": 50}
STAGES = {"0dur": {"web": 0.6, "code": 0.3, "math": 0.1}, "0.6dur": {"web": 0.2, "code": 0.3, "math": 0.5}}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weights": {"web": -1, "code": 1}}, r"'web': proportion -1 is negative; weights must be >= 0"),
        ({"weights": {"web": 0, "code": 0}}, r"weights summing to 0: give at least one source a positive weight"),
        ({"stages": {"0dur": {"web": 1}, "1.5dur": {"code": 1}}}, r"'1.5dur' starts outside the run.*\[0, 1\)"),
        ({"stages": {"0.2dur": {"web": 1}}}, r"first stage starts at '0.2dur'.*must start at '0dur'"),
        ({"weights": {"web": 1, "cod": 1}}, r"names \['cod'\], which are not sources.*check the spelling"),
        ({"weights": {"web": 1, "code": {"repeat": 2}}}, r"mixes proportions with repeat/choose"),
        ({"weights": {"web": {"choose": 2.5}}}, r"choose=2.5 must be a whole number"),
        ({"weights": {"web": {"take": 2}}}, r"is not a weight.*\{'repeat': r\}"),
        ({"stages": {"0dur": {"web": 1}, "5tok": {"code": 1}}}, r"'5tok' is in tok.*start stages in 'dur', 'ep'"),
        ({"stages": {"0dur": {"web": 1}}, "weights": {"web": 1}}, r"Give the mixture's weights once"),
        ({"weights": {"web": 1}, "epoch_size": 0}, r"epoch_size=0 must be a positive int"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_fix(kwargs, match):
    with pytest.raises(MixtureError, match=match):
        Mixture(sources=SOURCES, **kwargs)


def test_bad_sources_and_schemas_are_refused():
    with pytest.raises(MixtureError, match=r"'web' has rows=0: give its row count as a positive int"):
        Mixture(sources={"web": 0}, weights={"web": 1})
    with pytest.raises(MixtureError, match=r"Source 'web' has another schema than 'code'.*convert it first"):
        Mixture(
            sources={"web": {"rows": 5, "schema": {"ids": "int32"}}, "code": {"rows": 5, "schema": {"ids": "int64"}}},
            weights={"web": 1, "code": 1},
        )


def test_stages_out_of_order_or_past_the_run_are_refused_where_the_run_length_is_known():
    mixture = Mixture(sources=SOURCES, stages={"0dur": {"web": 1}, "0.5dur": {"code": 1}, "100sp": {"math": 1}})
    with pytest.raises(ValueError, match=r"Stage '100sp' starts at sample 100, not after stage '0.5dur'"):
        mixture.plan(seed=0, total_samples=1000)
    with pytest.raises(ValueError, match=r"'0.5dur' is a fraction of the run.*give max_duration in 'ep'"):
        mixture.plan(seed=0)
    late = Mixture(sources=SOURCES, stages={"0dur": {"web": 1}, "4ep": {"code": 1}})
    with pytest.raises(ValueError, match=r"at or after the run's end .*lengthen max_duration"):
        late.plan(seed=0, total_samples=2 * late.epoch_size)


def test_a_mixture_is_plain_data_equal_after_a_round_trip_and_hashable():
    mixture = Mixture(sources=SOURCES, stages=STAGES)
    data = json.loads(json.dumps(mixture.to_dict()))
    again = Mixture.from_dict(data)
    assert again == mixture and hash(again) == hash(mixture)
    assert Mixture(sources=SOURCES, weights=STAGES["0dur"]) == Mixture(sources=SOURCES, stages={"0dur": STAGES["0dur"]})
    assert Mixture(sources=SOURCES, weights={"web": 1}) != Mixture(sources=SOURCES, weights={"web": 2})
    reordered = Mixture(
        sources=dict(reversed(SOURCES.items())), stages={k: dict(reversed(v.items())) for k, v in STAGES.items()}
    )
    assert reordered == mixture and hash(reordered) == hash(mixture)
    assert reordered.plan(seed=3, total_samples=940).rows(1, 0, 470) == mixture.plan(seed=3, total_samples=940).rows(
        1, 0, 470
    )
    assert mixture.epoch_size == sum(SOURCES.values())


def test_absolute_stages_set_the_epoch_as_streaming_does():
    mixture = Mixture(sources=SOURCES, weights={"web": {"repeat": 0.5}, "code": {"repeat": 2}, "math": {"choose": 7}})
    assert mixture.epoch_size == 150 + 240 + 7
    plan = mixture.plan(seed=1)
    assert mixture.names == ("code", "math", "web")  # sorted: equal mixtures give the same plan
    assert plan.epoch_totals(0) == (240, 7, 150)
    rows = plan.rows(0, 0, plan.epoch_size)
    code = [r for s, r in rows if s == 0]
    assert Counter(Counter(code).values()) == {2: 120}  # repeat=2: each code row twice, the second pass after the first
    assert len(set(code[:120])) == 120


def test_permute_is_a_bijection():
    for size in (1, 2, 3, 17, 64, 1000):
        assert sorted(permute(i, size, 5) for i in range(size)) == list(range(size))


@st.composite
def mixtures(draw):
    rows = draw(st.lists(st.integers(1, 100), min_size=1, max_size=4).filter(lambda r: sum(r) >= 4))
    names = [f"s{i}" for i in range(len(rows))]
    weights = st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows)).filter(any)
    stages = {"0dur": dict(zip(names, draw(weights)))}
    if draw(st.booleans()):
        stages[draw(st.sampled_from(["0.25dur", "0.5dur", "0.7dur"]))] = dict(zip(names, draw(weights)))
    return Mixture(sources=dict(zip(names, rows)), stages=stages)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixtures(), st.integers(0, 2**31), st.integers(0, 2))
def test_plan_properties(mixture, seed, epoch):
    total = 3 * mixture.epoch_size
    plan = mixture.plan(seed=seed, total_samples=total)
    size = plan.epoch_size
    full = plan.rows(epoch, 0, size)
    # deterministic in (seed, epoch): a fresh plan gives the same order
    assert mixture.plan(seed=seed, total_samples=total).rows(epoch, 0, size) == full
    # each source gives its epoch total, and every row once per pass over it
    counts = Counter(s for s, _ in full)
    totals = plan.epoch_totals(epoch)
    assert [counts.get(i, 0) for i in range(len(totals))] == list(totals)
    for i, rows in enumerate(plan.source_rows):
        taken = [r for s, r in full if s == i]
        for start in range(0, len(taken), rows):
            one_pass = taken[start : start + rows]
            assert len(set(one_pass)) == len(one_pass)
    # resume anywhere: cursors equal the prefix's counts, and the rows from there equal the full order's
    for cut in {0, size // 3, size // 2, size - 1, size}:
        prefix = Counter(s for s, _ in full[:cut])
        assert list(plan.cursors(epoch, cut)) == [prefix.get(i, 0) for i in range(len(totals))]
        assert plan.rows(epoch, cut, size) == full[cut:]
    # proportions: every prefix of a segment holds each source within a few rows of its share
    for segment in plan.segments(epoch):
        length = segment.stop - segment.start
        for k in range(0, length + 1, max(1, length // 7)):
            got = Counter(s for s, _ in full[segment.start : segment.start + k])
            for i, quota in enumerate(segment.quotas):
                assert abs(got.get(i, 0) - quota * k / length) <= 2 + 2 * (length // LEAF).bit_length() + LEAF / 2


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 1000))
def test_world_size_independence_through_the_loader(batch_size, world_size, seed):
    import torch

    from raytrain_events.data.mixture_loader import MixtureLoader

    mixture = Mixture(sources={"a": 23, "b": 11, "c": 7}, weights={"a": 3, "b": 2, "c": 1})
    datasets = {n: [torch.tensor([i, r]) for r in range(mixture.rows(n))] for i, n in enumerate(mixture.names)}

    def global_order(world):
        loaders = [MixtureLoader(mixture, datasets, batch_size=batch_size, seed=seed) for _ in range(world)]
        for rank, loader in enumerate(loaders):
            loader.bind(rank=rank, world_size=world, seed=None, max_duration=None)
        out = []
        for batches in zip(*loaders):
            for batch in batches:
                out.extend(tuple(x.tolist()) for x in batch)
        return out

    one = global_order(1)
    assert len(one) == mixture.epoch_size
    many = global_order(world_size)
    assert many == one[: len(many)]
    assert len(one) - len(many) < world_size  # only a tail smaller than the world size is dropped


def test_a_switch_stage_keeps_every_position_before_it():
    """`Mixture.switched(at, weights)`: the plan before ``at`` is the original's (sources, rows, cursors), mid-stage
    or in a later epoch; from ``at`` on the new weights; a switch that is not a stage's start is refused."""
    mixture = Mixture(
        sources={"web": 5000, "code": 2000, "math": 700},
        stages={"0dur": {"web": 0.6, "code": 0.3, "math": 0.1}, "2000sp": {"web": 0.2, "code": 0.4, "math": 0.4}},
    )
    before = mixture.plan(seed=3, total_samples=30000)
    for at in (3001, 7699, 9000, 16000):
        switched = mixture.switched(at, {"math": 1})
        assert Mixture.from_dict(switched.to_dict()) == switched and switched.continues(mixture)
        assert not mixture.continues(switched)
        after = switched.plan(seed=3, total_samples=30000)
        epoch, position = divmod(at, mixture.epoch_size)
        assert after.rows(epoch, 0, position) == before.rows(epoch, 0, position)
        assert after.cursors(epoch, position) == before.cursors(epoch, position)
        rest = after.sources(epoch, position, mixture.epoch_size)
        assert set(rest) == {mixture.names.index("math")}
        for q in (position, mixture.epoch_size):  # cursors still count the plan's sources
            sources = after.sources(epoch, 0, q)
            assert after.cursors(epoch, q) == tuple(sources.count(i) for i in range(3))
    with pytest.raises(MixtureError, match="not the start of a stage after the first"):
        Mixture.from_dict({**mixture.to_dict(), "switches": ["0dur"]})
    with pytest.raises(ValueError, match="order the stages by their start"):  # a switch starts after every stage
        mixture.switched(1500, {"math": 1}).plan(seed=3, total_samples=30000)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixtures(), st.integers(0, 2**31), st.integers(1, 300), st.data())
def test_a_runs_batch_order_lists_each_global_batch_by_source(mixture, seed, window, data):
    """`batch_sources`: the plan's positions of each global batch (``window`` of them from the stream's
    entry ``anchor``) grouped by source: the same sources per batch, one run per source, any slice equal
    to the whole's (a rank's part, a feeder's step), and a stream entered at a later batch agreeing."""
    plan = mixture.plan(seed=seed, total_samples=2 * mixture.epoch_size)
    size = plan.epoch_size
    anchor = data.draw(st.integers(0, size - 1))
    whole = plan.batch_sources(1, anchor, size, anchor, window)
    assert plan.batch_sources(1, anchor, size, anchor, None) == plan.sources(1, anchor, size)
    for lo in range(anchor, size, window):
        hi = min(lo + window, size)
        batch = whole[lo - anchor : hi - anchor]
        assert Counter(batch) == Counter(plan.sources(1, lo, hi)) and batch == sorted(batch)
    a = data.draw(st.integers(anchor, size))
    b = data.draw(st.integers(a, size))
    assert plan.batch_sources(1, a, b, anchor, window) == whole[a - anchor : b - anchor]
    later = anchor + data.draw(st.integers(0, (size - anchor) // window)) * window  # a rebuilt feeder's entry
    assert plan.batch_sources(1, later, size, later, window) == whole[later - anchor :]
