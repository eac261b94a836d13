"""Sharded replica groups (``replica_group_size > 1``): what `RayTrainer` refuses before Ray starts, and the wrapping
of Ray Train's worker group that builds groups of several workers (`ray/_compat_worker_group.py`), without Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_events.parallel.config import FSDPConfig
from raytrain_events.ray import _compat_worker_group as wrapping
from raytrain_events.ray._compat import RayCompatError
from raytrain_events.ray.driver import RayTrainer
from tests.bad_input_helpers import no_ray, ray_kwargs, unread_dataset  # noqa: F401 (no_ray: a fixture)

pytest.importorskip("torchft")


def _sharded(**over):
    base = dict(fault_tolerance="replica_groups", num_workers=4, replica_group_size=2, parallelism=FSDPConfig())
    base.update(over)
    return ray_kwargs(**base)


@pytest.mark.parametrize(
    "over, named",
    [
        (dict(num_workers=6, replica_group_size=4), r"replica_group_size=4 does not divide num_workers=6.*e\.g\. 8"),
        (dict(num_workers=2), r"makes 1 replica group.*num_workers=4 or more"),
        (dict(replica_group_size=0), r"replica_group_size=0 must be a whole number"),
        (dict(parallelism="ddp"), r"replica_group_size=2 with parallelism='ddp'.*parallelism='fsdp'"),
        (dict(parallelism=FSDPConfig(context_parallel=2)), r"FSDPConfig\(context_parallel=2\) inside replica groups"),
        (
            dict(parallelism=FSDPConfig(tensor_parallel=4)),
            r"replica_group_size=2 workers cannot hold this mesh.*tensor_parallel=4",
        ),
        (dict(parallelism=FSDPConfig(replicate=4)), r"cannot hold this mesh.*replicate=4"),
        (dict(fault_tolerance=None), r"replica_group_size=2 sets the workers of each replica group, but this run has"),
    ],
)
def test_a_sharded_group_that_cannot_be_made_is_refused_before_ray_starts(no_ray, over, named):  # noqa: F811
    with pytest.raises(ValueError, match=named) as error:
        RayTrainer(**_sharded(**over))
    assert "Fix:" in str(error.value)


def test_a_ray_whose_worker_group_cannot_be_wrapped_is_refused_before_ray_starts(no_ray, monkeypatch):  # noqa: F811
    """A Ray that changed what the wrapping relies on (here: ``_create_workers`` lost ``replica_group_size``)."""
    from ray.train.v2._internal.execution.worker_group import worker_group

    def create_workers(self, num_workers, placement_group, resources_per_worker):
        raise AssertionError("never called")

    monkeypatch.setattr(worker_group.WorkerGroup, "_create_workers", create_workers)
    with pytest.raises(RayCompatError, match=r"replica_group_size > 1 needs.*Fix: install ray==2.60.0") as error:
        RayTrainer(**_sharded())
    assert "_create_workers" in str(error.value)
    RayTrainer(**_sharded(replica_group_size=1, parallelism="ddp"))  # one-worker groups need none of it


def test_the_installed_ray_has_what_the_wrapping_needs():
    wrapping.probe()


class _Group:
    def __init__(self, workers):
        self.workers = workers

    def get_workers(self):
        return self.workers


def _worker_group(size: int, groups: list):
    return SimpleNamespace(
        _train_run_context=SimpleNamespace(backend_config=SimpleNamespace(replica_group_size=size)),
        _worker_group_context=SimpleNamespace(resources_per_worker={"CPU": 1}),
        _replica_group_callbacks=["callback"],
        _replica_groups=groups,
        _worker_rank_to_replica_group_rank=None,
    )


def test_the_wrapped_worker_group_asks_ray_for_groups_of_the_run_s_size():
    calls = []

    def create_workers(self, *args, **kwargs):
        calls.append(kwargs)

    wrapped = wrapping._wrap_create_workers(create_workers)
    start = _worker_group(3, None)
    wrapped(start, 12, "pg", {"CPU": 1}, replica_group_size=1)  # (1) the start asks for groups of one
    assert calls[-1]["replica_group_size"] == 3 and calls[-1]["starting_world_rank"] == 0
    replacing = _worker_group(3, [None] * 4)
    replacing._raytrain_events_replacing = 2  # (3) group 2 of 4 groups of 3: world ranks 6, 7, 8 of 12
    wrapped(replacing, 3, "pg", {"CPU": 1}, [6, 7, 8], starting_world_rank=2, world_size=4, replica_group_size=3)
    assert (calls[-1]["starting_world_rank"], calls[-1]["world_size"]) == (6, 12)
    plain = _worker_group(1, None)  # every other run: exactly what Ray asked
    wrapped(plain, 4, "pg", {"CPU": 1}, replica_group_size=1)
    assert calls[-1]["replica_group_size"] == 1


def test_the_start_s_groups_of_one_become_groups_of_consecutive_ranks():
    workers = [SimpleNamespace(distributed_context=SimpleNamespace(world_rank=r)) for r in (5, 0, 3, 1, 4, 2, 7, 6)]
    group = _worker_group(4, [_Group([w]) for w in workers])
    wrapping.regroup(group, workers, 4)  # (2)
    assert [[w.distributed_context.world_rank for w in g.get_workers()] for g in group._replica_groups] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert group._worker_rank_to_replica_group_rank == {r: r // 4 for r in range(8)}


def test_eval_sets_and_validation_are_accepted_and_each_position_evaluates_its_part():
    """An in-loop eval set (and asynchronous validation) with groups of several workers: accepted on the driver;
    each eval set is cut once, on the driver, into ``replica_group_size`` equal parts and position ``p`` of every
    group gets part ``p`` (a group evaluates the whole set, alone); only the train set is cut by the quorum. No Ray
    here: the datasets are stand-ins."""
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.ray.fault_tolerance import choose

    class Set:
        def __init__(self, name, rows=48):
            self.name, self.rows = name, rows

        def split(self, n, equal):
            assert equal  # a group's FSDP forwards are collectives: the same number of batches at every position
            part = self.rows // n
            return [SimpleNamespace(iterator=lambda p=p: (self.name, p, n), count=lambda: part) for p in range(n)]

    class Data:
        def configure(self, datasets, world, handles, nodes):
            assert set(datasets) == {"train"}, datasets
            return [{"train": ("train", rank)} for rank in range(world)]

    validation = dict(validation={"datasets": ["test"]}, checkpoint=CheckpointConfig(save_interval="5ba"))
    sets = {"train": unread_dataset(), "val": unread_dataset(), "test": unread_dataset()}
    RayTrainer(**_sharded(datasets=sets, **validation))  # accepted
    trainer = RayTrainer(**_sharded(num_workers=6, replica_group_size=3, datasets=sets))
    data = {"train": Set("train"), "val": Set("val"), "test": lambda: Set("test")}  # Ray Train's zero-argument form
    side, ray_datasets = choose(trainer.spec, trainer.plan).worker_side(Data(), data, None)
    assert ray_datasets == {}
    assert side.shards == [("train", r) for r in range(6)]
    assert side.evals == {name: [(name, p, 3) for p in range(3)] for name in ("val", "test")}
    # FSDP x TP inside groups of 4 (2 x 2): a part per tensor group, shared by its two ranks
    tp = RayTrainer(**_sharded(num_workers=8, replica_group_size=4, parallelism=FSDPConfig(tensor_parallel=2)))
    side, _ = choose(tp.spec, tp.plan).worker_side(Data(), data, None)
    assert side.layout.tensor_parallel == 2 and side.evals["val"] == [("val", 0, 2), ("val", 1, 2)]
    assert [side.layout.eval_part(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # a set too small to give every position a row: refused, not evaluated over nothing
    with pytest.raises(ValueError, match=r"eval set 'val' has fewer rows than the 2 data-parallel workers.*Fix:"):
        choose(tp.spec, tp.plan).worker_side(Data(), {**data, "val": Set("val", rows=1)}, None)
