"""Replica groups: a restart of the whole run inside one fit (every group lost, all resume from an older
storage checkpoint) continues exactly on the feeder the driver made, which has moved on past those rows.

* The groups' loaders (`ReplicaLoader`) on the driver's shards and a real feeder actor, a stand-in for
  torchft's Manager (no Ray Train: a whole-run restart in a `RayTrainer` run costs two more group starts):
  17 steps, then every group starts again at batch 10 (the checkpoint's position) and trains to the epoch's
  end; every row is trained once after the checkpoint, in order. On main the feeder refused: ``rows from
  120 were dropped``.
* The feeder alone (no Ray): the same at the start of an epoch the ranks have moved into, and a call
  waiting on the pass that is opened again is answered from the new pass, not left waiting.
"""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace
from typing import List

import pytest

from raytrain_events.core.timestamp import Timestamp
from raytrain_events.data.ray.feeder import EpochFeeder

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "ray")
)  # test_feeder_index
from test_feeder_index import FakeDataset, _rows  # noqa: E402

ROWS, GROUPS, GLOBAL = 600, 3, 12  # 50 global batches


def _groups(shards, at: Timestamp):
    """Each group's `ReplicaLoader` (a new process: a new loader) whose state is at ``at``."""
    from raytrain_events.ray.replica_groups import ReplicaState
    from raytrain_events.ray.replica_loader import ReplicaLoader

    out = []
    for group, shard in enumerate(shards):
        manager = SimpleNamespace(
            start_quorum=lambda: None,
            current_step=lambda: 1,
            num_participants=lambda: GROUPS,
            participating_rank=lambda g=group: g,
        )
        replicas = ReplicaState()
        replicas.state = SimpleNamespace(timestamp=at)
        out.append(ReplicaLoader(shard, manager, replicas, device="cpu"))
    return out


def _train(loaders, steps: int) -> List[int]:
    """``steps`` committed steps of every group in lockstep: the rows the run trained (the groups' parts)."""
    trained: List[int] = []
    iters = [iter(loader) for loader in loaders]
    for _ in range(steps):
        parts = [next(it, None) for it in iters]
        if any(p is None for p in parts):
            assert all(p is None for p in parts)
            break
        trained += [row for part in parts for row in part["id"].tolist()]
        for loader in loaders:
            state = loader.replicas.state
            state.timestamp = state.timestamp.to_next_batch(samples=loader.global_rows)
    return trained


@pytest.mark.ray
def test_every_group_restarting_from_an_older_checkpoint_continues_exactly(ray_cluster) -> None:
    ray = ray_cluster
    from raytrain_events.data.order import GlobalBatch
    from raytrain_events.data.ray.data_config import TrainDataConfig

    dataset = ray.data.range(ROWS, override_num_blocks=50)
    config = TrainDataConfig(batch=GlobalBatch(GLOBAL // GROUPS, GLOBAL), tensor_parallel=GROUPS)
    shards = [s["train"] for s in config.configure({"train": dataset}, GROUPS, None, None)]  # as the driver does
    assert _train(_groups(shards, Timestamp()), 17) == list(range(17 * GLOBAL))
    checkpoint = Timestamp()
    for _ in range(10):  # the newest storage checkpoint: batch 10, older than the feeder's pass (17)
        checkpoint = checkpoint.to_next_batch(samples=GLOBAL)
    rest = _train(_groups(shards, checkpoint), 100)  # every group restarted: the whole run resumes at batch 10
    assert rest == list(range(10 * GLOBAL, ROWS))  # every row after the checkpoint once, in order


@pytest.mark.ray
def test_trains_cleaner_in_the_test_cluster_asks_no_other_ray(ray_cluster) -> None:
    """The cause of a whole-run restart seen in the replica bench: Ray Train's placement-group cleaner asked the
    state API of another Ray instance on the machine (one with a dashboard, started 2 s before), did not find
    its controller there and removed the run's placement group. In this session's cluster (as in the bench's) a
    worker's state API call fails instead, which the cleaner skips (`embedded.own_state_api`)."""
    ray = ray_cluster
    from raytrain_events.ray.embedded import NO_API_SERVER

    def probe() -> tuple:
        from ray.util.state import get_actor
        from ray.util.state.exception import RayStateApiException

        try:
            found = get_actor(ray.get_runtime_context().get_job_id().rjust(32, "f"), timeout=2)
        except RayStateApiException:
            found = "failed"
        return os.environ.get("RAY_API_SERVER_ADDRESS"), found

    assert ray.get(ray.remote(num_cpus=0)(probe).remote()) == (NO_API_SERVER, "failed")


def test_a_start_before_what_the_pass_holds_opens_it_again() -> None:
    sizes = [10] * 30
    feeder = EpochFeeder(FakeDataset(sizes), 1, 10, consumers=3)
    for rank in range(3):
        feeder.start_epoch(0, 0, None, rank, resume_batch=1)
        feeder.batches(0, 0, rank, 0, 8)  # every group past batch 7: the pass dropped the rows before it
    for rank in range(3):  # all groups back at the epoch's start (a checkpoint at the end of the epoch before)
        feeder.start_epoch(0, 0, None, rank, resume_batch=1)
    served = [feeder.batches(0, 0, rank, 0, 40) for rank in range(3)]
    assert all(s == served[0] for s in served)
    assert [row for slices in served[0][:-1] for row in _rows(slices, sizes)] == list(range(300))
    feeder.epochs[(0, 0)].stop()


def test_a_call_waiting_on_a_pass_opened_again_is_answered_by_the_new_one() -> None:
    sizes = [10] * 30
    gate = threading.Event()
    feeder = EpochFeeder(FakeDataset(sizes, gate=gate, gate_at=12), 1, 10, consumers=2)
    feeder.start_epoch(0, 0, None, 0, resume_batch=1)
    feeder.start_epoch(0, 0, None, 1, resume_batch=1)
    feeder.batches(0, 0, 0, 0, 6)
    feeder.batches(0, 0, 1, 0, 6)
    answer: list = []
    waiting = threading.Thread(target=lambda: answer.append(feeder.batches(0, 0, 1, 12, 1)))
    waiting.start()  # rank 1 waits for rows the stream has not reached (the gate)
    waiting.join(0.3)
    assert waiting.is_alive()
    feeder.start_epoch(0, 0, None, 0, resume_batch=2)  # rank 0 restarted from batch 2: the pass opens again
    waiting.join(5)
    gate.set()
    assert not waiting.is_alive() and answer == [None]  # "start the epoch again": the loader does, and asks again
    feeder.start_epoch(0, 0, None, 1, resume_batch=12)
    assert _rows(feeder.batches(0, 0, 1, 12, 1)[0], sizes) == list(range(120, 130))
    feeder.epochs[(0, 0)].stop()
