"""`SpikeGuard` under replica groups of several workers (``fault_tolerance="replica_groups", replica_group_size=2``)
on the session's real local Ray: 2 groups x 2 FSDP2 workers under torchft. A row planted at a known global position
spikes the loss of the one *worker* whose part of the global batch holds it; its group's two workers judge the
group's values (the loss over both workers' rows, the gradient norm over both workers' shards: summed inside the
group first), so both vote the same on their own position's all-reduce across the groups, and every worker of every
group rolls back at that same committed step, to the same host snapshot (each of its own shards), and skips the same
global-order rows; the run ends at the uninterrupted run's Timestamp (trained + skipped), every other row trained
once, and the groups' final shards identical position by position. (4+ groups: tests/trainer/test_spike_groups.py
scripts 4 groups x 2 workers; groups of one worker share every part but the in-group sum.)

The order is the dataset's (no shuffle): global batch ``b`` (1-based) is rows ``[12 (b - 1), 12 b)``, cut into
2 groups x 2 workers = 4 parts of 3 by the step's quorum; the planted row 150 is in batch 13, the first row of the
second participating group's part (its first worker's). The snapshots are every 4 committed steps from the fit's
start and at every quorum change (a group joining the first quorums late moves them), so the test reads the
restored step from the workers and checks they agree.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import Counter

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.callbacks import SpikeGuard
from tests import resume_helpers as h
from tests.ray.fault_tolerance import replica_helpers
from tests.ray.fault_tolerance.replica_helpers import RecordShards
from tests.ray.test_spike_run import PLANTED, _plant

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(h)
ray_cloudpickle.register_pickle_by_value(replica_helpers)
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
GROUPS = 2
GROUP_SIZE = 2
WORKERS = GROUPS * GROUP_SIZE


class DumpGroupGuard(Callback):
    """Each worker writes its group and position, its guard's skip list, rollbacks, detector window, trained counts
    and skipped record at the fit's end."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_end(self, state, logger) -> None:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        guard = next(c for c in state.callbacks if isinstance(c, SpikeGuard))
        out = {
            "group": rank // GROUP_SIZE,
            "position": rank % GROUP_SIZE,
            "detector": guard.detector.state_dict(),
            "skips": guard.skips.state_dict()["ranges"],
            "rollbacks": guard.rollbacks,
            "trained": guard.trained(state),
            "skipped": state.skipped.state_dict(),
            "timestamp": int(state.timestamp.batch),
        }
        with open(os.path.join(self.folder, f"guard-{os.getpid()}.json"), "w") as fh:
            json.dump(out, fh)


class StartTogether(Callback):
    """Each worker waits at FIT_START until every worker has started (`RecordShards` writes ``proc-<pid>.json`` at
    its FIT_START, before this): on a loaded machine the first group would otherwise train the short epoch out
    before the last one joins, which then waits for a quorum that never comes."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        import time

        deadline = time.monotonic() + 240
        while len(glob.glob(os.path.join(self.folder, "proc-*.json"))) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.mark.timeout(600)
def test_every_worker_of_every_sharded_replica_group_rolls_back_at_the_same_step_and_skips_the_same_rows(
    ray_cluster, tmp_path
):
    import ray.data
    import torch

    from raytrain_events import FSDPConfig, RayTrainer

    data = str(tmp_path / "parquet")
    h.write_parquet(data)
    _plant(data)
    records, dumps = str(tmp_path / "records"), str(tmp_path / "guard")
    os.makedirs(records), os.makedirs(dumps)
    with open(os.path.join(records, "done"), "w"):
        pass  # RecordShards: no pacing
    result = RayTrainer(
        model=h.make_model,
        optimizers=h.make_sgd,
        datasets={"train": ray.data.read_parquet(data)},
        max_duration="1ep",
        batch_size=h.GLOBAL_BATCH // WORKERS,  # rows per worker
        num_workers=WORKERS,
        replica_group_size=GROUP_SIZE,
        parallelism=FSDPConfig(),
        resources_per_worker={"CPU": 0.5},
        fault_tolerance="replica_groups",
        callbacks=lambda: [
            RecordShards(records, 0.0, GROUP_SIZE),
            StartTogether(records),
            # The norm judged too (each worker's share of its group's, summed in the group), at a bar only the
            # planted row's step could pass: the loss's test fires first there.
            SpikeGuard(snapshot_interval=4, warmup=5, loss_ratio=5.0, grad_zscore=50.0),
            DumpGroupGuard(dumps),
        ],
        report_every_s=2.0,
        storage_path=str(tmp_path / "runs"),
        run_name="spiky_sharded_groups",
        seed=0,
    ).fit()
    # The uninterrupted run's Timestamp: the skipped rows count as positions (trained + skipped).
    assert h.timestamp_of(result) == {"epoch": 1, "batch": h.BATCHES_PER_EPOCH, "sample": h.ROWS, "token": 0}
    guards = []
    for path in sorted(glob.glob(os.path.join(dumps, "guard-*.json"))):
        with open(path) as fh:
            guards.append(json.load(fh))
    assert sorted((g["group"], g["position"]) for g in guards) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # none replaced
    # One rollback, in every worker: at batch 13 (the planted row's), to the same snapshot, the same rows skipped.
    first = guards[0]["rollbacks"]
    assert len(first) == 1 and first[0]["spike_batch"] == 13 == first[0]["batch"] and first[0]["from"] == "host"
    restored = first[0]["restored_batch"]
    assert 13 - 4 <= restored < 13
    window = [0, restored * h.GLOBAL_BATCH, 13 * h.GLOBAL_BATCH]
    assert first[0]["skipped"] == [window]
    for guard in guards:
        drop = ("reason",)
        assert [{k: v for k, v in r.items() if k not in drop} for r in guard["rollbacks"]] == [
            {k: v for k, v in first[0].items() if k not in drop}
        ]
        assert guard["skips"] == [[*window, 13 - restored, 0]]
        skipped_rows = window[2] - window[1]
        assert guard["trained"] == {"batch": 17 - (13 - restored), "sample": h.ROWS - skipped_rows, "token": 0}
        assert guard["skipped"]["samples"] == skipped_rows and guard["timestamp"] == 17
    # The group holding row 150 saw the spike in both its workers (one of them trained only clean rows: it judged the
    # group's loss), the other group's two workers voted it; each group's workers judged the same values throughout.
    by_group = {g: [x for x in guards if x["group"] == g] for g in range(GROUPS)}
    reasons = {g: {x["rollbacks"][0]["reason"] for x in members} for g, members in by_group.items()}
    assert sorted(len(r) for r in reasons.values()) == [1, 1]
    assert sorted("loss" in next(iter(r)) for r in reasons.values()) == [False, True]
    assert "seen in another replica group" in {next(iter(r)) for r in reasons.values()}
    for members in by_group.values():
        assert members[0]["detector"] == members[1]["detector"] and len(members[0]["detector"]["norms"]) >= 5
    # Every row outside the window trained once (the committed steps' global batches, by their batch number).
    committed = {}
    for path in glob.glob(os.path.join(records, "rows-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                if r["committed"]:
                    assert committed.setdefault(r["batch"], r["global"]) == r["global"]  # the same rows in each worker
    assert sorted(committed) == list(range(1, 18))
    kept = [i for b, ids in committed.items() if not restored < b <= 13 for i in ids]
    assert Counter(kept) == Counter(i for i in range(h.ROWS) if not window[1] <= i < window[2])
    assert PLANTED in range(window[1], window[2])
    # The replicas are identical at the end (the rollback left no group apart): the same shards position by position.
    finals = [torch.load(p, weights_only=False) for p in glob.glob(os.path.join(records, "final-*.pt"))]
    assert sorted((f["group"], f["position"]) for f in finals) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for final in finals:
        twin = next(f for f in finals if f["position"] == final["position"] and f["group"] != final["group"])
        positions = {k: v for k, v in final["timestamp"].items() if "wct" not in k}  # (each worker's own clock)
        assert positions == {k: v for k, v in twin["timestamp"].items() if "wct" not in k}
        for name, tensor in final["shards"].items():
            assert torch.equal(twin["shards"][name], tensor), name
        for name, tensor in final["full"].items():
            assert torch.equal(finals[0]["full"][name], tensor), name
