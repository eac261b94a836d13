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
        (dict(parallelism=FSDPConfig(tensor_parallel=2)), r"FSDPConfig\(tensor_parallel=2\) inside replica groups"),
        (dict(parallelism=FSDPConfig(replicate=4)), r"cannot hold this mesh.*replicate=4"),
        (dict(fault_tolerance=None), r"replica_group_size=2 sets the workers of each replica group, but this run has"),
        (
            dict(datasets={"train": unread_dataset(), "val": unread_dataset()}),
            r"eval datasets with replica groups of 2 workers.*replica_group_size=1",
        ),
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
