"""Sharded replica groups (``fault_tolerance="replica_groups", replica_group_size=2``): 2 groups x 2 FSDP2 workers on
the session's Ray; a worker of a group SIGKILLed from outside twice mid-epoch (first group 1's second worker, then
the lead group 0's first: the one that holds the group's torchft Manager server and store), then the same run fitted
again by name for one more epoch (a whole-run restart: every worker loads the lead group's sharded checkpoint).

Each time Ray replaces that group alone (both its workers, new processes); the other group keeps committing steps
with its process ids unchanged; the replaced group's workers heal from the live group's same-position shards
(`ShardedReplicaState`: a recorded heal, no storage read) and the run ends with the uninterrupted run's Timestamp,
every row once per epoch, and every group's parameters (its shards put together) within float tolerance of a plain
local `Trainer` over the same global batches. Storage checkpoints on: each save point saved once, by the lead of its
step (group 1 while group 0 is away), ``keep`` honoured. The data: 192 rows (16 global batches of 12; equal parts
per worker at any quorum, so the averaged gradient is the global batch's mean, as in the local run).

Eval through the kills: an eval set (48 rows) at every save point, each group evaluating all of it (24 rows per
position); at every eval point each live group's metrics equal the uninterrupted local run's at that batch, each
save point's history entry carries them (those group 1 saved while group 0 was away included), and the 9th
checkpoint's asynchronous validation (a Ray task resharding the lead's 2-rank checkpoint) matches them. The resumed
run (no eval: the first run checked it) trains with tensor parallelism inside each group
(``FSDPConfig(tensor_parallel=2)``: groups of one tensor group of 2), loading the FSDP checkpoint resharded, and
ends exact too.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from typing import Optional

import pytest

from tests.ray.fault_tolerance.replica_helpers import RecordShards, live_procs, make_tensor_parallel_model
from tests.resume_helpers import make_model, make_sgd, read_records, write_parquet

pytestmark = pytest.mark.ray

GROUP_SIZE = 2
GROUPS = 2
FILE_ROWS = (101, 67, 24)  # 192 rows
ROWS = sum(FILE_ROWS)
GLOBAL_BATCH = 12
BATCHES = ROWS // GLOBAL_BATCH  # 16 per epoch
EPOCHS = 6  # 96 steps: at 0.5 s a step until both kills are done (then unpaced), room for two slow rejoins
SLEEP_S = 0.5
SAVE_EVERY = 10
EVAL_ROWS = 48  # the eval set: the first 48 rows, 24 per position of a group (2 batches of 12 each)
VALIDATE_EVERY = 9  # checkpoints: the 9th (batch 90, kept to the end) is validated asynchronously
VICTIMS = ((1, 1), (0, 0))  # (group, position): a follower group's second worker, then the lead's first


def _live(folder: str, group: int, position: int):
    procs = [p for p in live_procs(folder) if p["group"] == group and p["position"] == position]
    return max(procs, key=lambda p: p["t"]) if procs else None


def _committed(folder: str, pid: int) -> int:
    path = os.path.join(folder, f"rows-{pid}.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip() and json.loads(line)["committed"])


def _last_batch(folder: str, pid: int) -> int:
    with open(os.path.join(folder, f"rows-{pid}.jsonl")) as f:
        return max(json.loads(line)["batch"] for line in f if line.strip() and json.loads(line)["committed"])


def _kill_twice(folder: str, kills: list, stop: threading.Event) -> None:
    """SIGKILL each victim once every worker has committed 3 steps (mid-epoch), after the previous victim's group is
    back (the lead 2-5 batches into a save interval: the next save falls due while it is away, not while it writes
    one); record the other group's pids and the steps it committed while the victim's group was away."""
    try:
        for group, position in VICTIMS:
            while not stop.is_set():
                procs = [_live(folder, g, p) for g in range(GROUPS) for p in range(GROUP_SIZE)]
                ready = all(p is not None and _committed(folder, p["pid"]) >= 3 for p in procs)
                if ready and group == 0:
                    ready = _last_batch(folder, _live(folder, group, position)["pid"]) % SAVE_EVERY in (2, 3, 4, 5)
                if ready:
                    break
                time.sleep(0.05)
            if stop.is_set():
                return
            victim = _live(folder, group, position)
            others = {p: _live(folder, 1 - group, p)["pid"] for p in range(GROUP_SIZE)}
            before = {pid: _committed(folder, pid) for pid in others.values()}
            os.kill(victim["pid"], signal.SIGKILL)
            kill = {"pid": victim["pid"], "group": group, "t": time.time(), "others": others}
            while not stop.is_set():  # until both workers of the group are new processes that committed steps
                back = [_live(folder, group, p) for p in range(GROUP_SIZE)]
                if all(b is not None and b["t"] > kill["t"] and _committed(folder, b["pid"]) >= 3 for b in back):
                    break
                time.sleep(0.2)
            kill["away_steps"] = {pid: _committed(folder, pid) - n for pid, n in before.items()}
            kill["others_after"] = {p: (_live(folder, 1 - group, p) or {}).get("pid") for p in range(GROUP_SIZE)}
            kill["back_s"] = time.time() - kill["t"]
            kills.append(kill)
    finally:
        with open(os.path.join(folder, "done"), "w"):
            pass


def _trainer(tmp_path, data, folder, epochs=EPOCHS, tensor_parallel=1, evaluate=True):
    import pyarrow.parquet as pq
    import ray.data

    from raytrain_events import CheckpointConfig, FSDPConfig, RayTrainer
    from raytrain_events.ray.checkpointing.validation import AsyncValidation

    evals = dict(
        val=ray.data.from_arrow(pq.read_table(data).slice(0, EVAL_ROWS)),
        val_async=ray.data.from_arrow(pq.read_table(data).slice(0, EVAL_ROWS)),
    )
    validation = AsyncValidation(datasets=["val_async"], every=VALIDATE_EVERY, resources={"CPU": 0.5})
    return RayTrainer(
        model=make_model if tensor_parallel == 1 else make_tensor_parallel_model,
        optimizers=make_sgd,
        # An eval set at every save point (each group evaluates all of it, a part per position), and the same rows
        # validated asynchronously (a Ray task loading the lead's 2-rank sharded checkpoint) on the 9th checkpoint.
        datasets={"train": ray.data.read_parquet(data), **(evals if evaluate else {})},
        validation=validation if evaluate else None,
        eval_interval=f"{SAVE_EVERY}ba",
        eval_batch_size=EVAL_ROWS // (2 * GROUP_SIZE),
        max_duration=f"{epochs}ep",
        batch_size=GLOBAL_BATCH * tensor_parallel // (GROUPS * GROUP_SIZE),  # rows per data-parallel worker
        num_workers=GROUPS * GROUP_SIZE,
        replica_group_size=GROUP_SIZE,
        parallelism=FSDPConfig(tensor_parallel=tensor_parallel),
        resources_per_worker={"CPU": 0.5},
        fault_tolerance="replica_groups",
        max_failures=4,
        callbacks=lambda: [RecordShards(folder, SLEEP_S, GROUP_SIZE)],
        report_every_s=2.0,
        storage_path=str(tmp_path / "runs"),
        run_name="sharded",
        seed=0,
        checkpoint=CheckpointConfig(save_interval=f"{SAVE_EVERY}ba", keep=2, save_every_n_seconds=None),
    )


def _uninterrupted(data: str, epochs: int, evals: Optional[dict] = None):
    """The same training in one process, no Ray: the global batches in order, SGD on each batch's mean loss; the
    eval set's metrics at each eval point go to ``evals`` (batch -> metrics)."""
    import pyarrow.parquet as pq
    import torch

    from raytrain_events import Callback, Trainer

    class RecordEvals(Callback):
        def eval_end(self, state, logger) -> None:
            values = {k: float(v) for k, v in logger.metrics.items() if k.startswith("metrics/val/")}
            if evals is not None:
                evals[int(state.timestamp.batch)] = values

    table = pq.read_table(data).to_pydict()
    rows = [{"id": i, "x": torch.tensor(x), "y": y} for i, x, y in zip(table["id"], table["x"], table["y"])]
    rows.sort(key=lambda r: r["id"])
    model = make_model()
    loader = torch.utils.data.DataLoader(rows, batch_size=GLOBAL_BATCH)
    val = torch.utils.data.DataLoader(rows[:EVAL_ROWS], batch_size=EVAL_ROWS // (2 * GROUP_SIZE))
    Trainer(
        model=model,
        optimizers=make_sgd(model),
        train_dataloader=loader,
        eval_dataloader={"val": val},
        eval_interval=f"{SAVE_EVERY}ba",
        callbacks=[RecordEvals()],
        max_duration=f"{epochs}ep",
    ).fit()
    return model


def _check_rows(folder: str, epochs: range, tensor_parallel: int = 1) -> None:
    """Each committed step trained its global batch's rows once between the data-parallel parts of its quorum (the
    ranks of a tensor group the same rows); every row once per epoch; the global batches in order."""
    steps: dict = {}
    procs = (json.load(open(path)) for path in glob.glob(os.path.join(folder, "proc-*.json")))
    positions = {p["pid"]: p["position"] for p in procs}
    for r in read_records(folder):
        if r["committed"]:
            steps.setdefault((r["epoch"], r["batch_in_epoch"]), []).append(r)
    for epoch in epochs:  # after a committed step: (epoch, 1..BATCHES)
        keys = [(epoch, b) for b in range(1, BATCHES + 1)]
        seen = []
        for b, key in enumerate(keys, 1):
            records = steps.get(key)
            assert records, f"epoch {epoch} batch {b}: no committed step"
            tensor_groups: dict = {}
            for r in records:  # the ranks of a tensor group trained the same rows
                tensor_groups.setdefault((r["group"], positions[r["pid"]] // tensor_parallel), []).append(r["ids"])
            assert all(all(i == ids[0] for i in ids) for ids in tensor_groups.values()), (epoch, b, tensor_groups)
            ids = [i for parts in tensor_groups.values() for i in parts[0]]
            expected = list(range((b - 1) * GLOBAL_BATCH, b * GLOBAL_BATCH))
            assert sorted(ids) == expected, (epoch, b, sorted(ids))
            assert len(records) == records[0]["participants"] * GROUP_SIZE, (epoch, b, records)
            seen += ids
        assert sorted(seen) == list(range(ROWS)), epoch


def _check_checkpoint(result, reference: dict, tmp_path, epochs: int = EPOCHS) -> None:
    import torch

    from raytrain_events import CheckpointConfig, Trainer

    model = make_model()
    config = CheckpointConfig(load_from=result.checkpoints[-1].url, save_folder=str(tmp_path / f"local-{epochs}"))
    rows = torch.utils.data.DataLoader([{"x": torch.zeros(4), "y": 0}], batch_size=1)  # a train set: load it all
    loaded = Trainer(
        model=model, optimizers=make_sgd(model), train_dataloader=rows, max_duration=f"{epochs}ep", checkpoint=config
    )
    stamp = loaded.state.timestamp
    assert (int(stamp.epoch), int(stamp.batch), int(stamp.sample)) == (epochs, BATCHES * epochs, ROWS * epochs)
    for name, value in model.named_parameters():
        assert torch.allclose(value, reference[name], atol=1e-5), (name, (value - reference[name]).abs().max())


def test_sharded_replica_groups_train_through_two_kills(ray_cluster, tmp_path):
    import torch

    data = str(tmp_path / "data")
    write_parquet(data, file_rows=FILE_ROWS)
    folder = str(tmp_path / "rec")
    os.makedirs(folder)
    kills: list = []
    stop = threading.Event()
    chaos = threading.Thread(target=_kill_twice, args=(folder, kills, stop), daemon=True)
    chaos.start()
    try:
        result = _trainer(tmp_path, data, folder).fit()
    finally:
        stop.set()
        chaos.join(timeout=30)
    assert len(kills) == 2, f"the run ended before both kills: {kills}"
    assert {k: result.timestamp.get_value(u) for k, u in (("epoch", "ep"), ("batch", "ba"), ("sample", "sp"))} == {
        "epoch": EPOCHS,
        "batch": BATCHES * EPOCHS,
        "sample": ROWS * EPOCHS,
    }
    procs = [json.load(open(p)) for p in glob.glob(os.path.join(folder, "proc-*.json"))]
    finals = [torch.load(p, weights_only=False) for p in glob.glob(os.path.join(folder, "final-*.pt"))]
    by_pid = {int(os.path.basename(p)[6:-3]): f for p, f in zip(glob.glob(os.path.join(folder, "final-*.pt")), finals)}
    for kill in kills:
        # The other group kept stepping while the victim's group was away, in the same processes to the end.
        assert all(n > 0 for n in kill["away_steps"].values()), kill
        assert kill["others_after"] == kill["others"], kill
        print(
            f"kill of group {kill['group']}'s worker {kill['pid']}: back in {kill['back_s']:.1f} s, the other "
            f"group committed {kill['away_steps']} steps meanwhile"
        )
        # The victim's group was replaced whole: two new processes, each healed from the live group, none read storage.
        new = [p for p in procs if p["group"] == kill["group"] and p["t"] > kill["t"]]
        assert sorted(p["position"] for p in new) == [0, 1], (kill, new)
        for p in new:
            final = by_pid[p["pid"]]
            assert final["healed"] >= 1 and final["loaded"] is None, (p, final["healed"], final["loaded"])
    # Group 0 ran in 2 processes per position... (positions: the first workers, and the replacements).
    assert sorted((p["group"], p["position"]) for p in procs) == [(0, 0), (0, 0), (0, 1), (0, 1)] + [
        (1, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]
    _check_rows(folder, range(EPOCHS))
    # Each group's parameters (its two shards put together) are the uninterrupted run's, and so is the newest
    # checkpoint (the lead group's 2-rank sharded save), loaded into a plain local Trainer: what a restart reads.
    local_evals: dict = {}
    reference = dict(_uninterrupted(data, EPOCHS, local_evals).named_parameters())
    _check_checkpoint(result, reference, tmp_path)
    assert len(finals) == GROUPS * GROUP_SIZE, [(f["group"], f["position"]) for f in finals]
    worst = 0.0
    for group in range(GROUPS):
        parts = sorted((f for f in finals if f["group"] == group), key=lambda f: f["position"])
        for name, value in reference.items():
            whole = torch.cat([part["shards"][name] for part in parts])
            assert torch.allclose(whole, value.detach(), atol=1e-5), (group, name, (whole - value).abs().max())
            worst = max(worst, float((whole - value.detach()).abs().max()))
    print(f"largest difference from the uninterrupted run's parameters: {worst:.2e}")
    # One saver per save point (the lead of its step: group 1 while group 0 was away), keep=2 honoured.
    saves = [json.loads(line) for p in glob.glob(os.path.join(folder, "saves-*.jsonl")) for line in open(p)]
    points = {}
    for s in saves:  # not a late save: a lead that died writing a save point's checkpoint recorded that save point
        if not s["late_for"]:
            points.setdefault(s["batch"], set()).add(s["group"])
    end = BATCHES * EPOCHS
    # Each save point saved once, at its batch or, when the save before it still uploaded then (a loaded machine), at
    # the first batch after that upload (`Checkpointer._save_unless_busy`: training never waits), before the next.
    got = sorted(points)
    assert len(got) == end // SAVE_EVERY + 1 and got[-1] == end, got
    assert all(p <= b < p + SAVE_EVERY for p, b in zip(range(SAVE_EVERY, end, SAVE_EVERY), got)), got
    assert all(len(groups) == 1 for groups in points.values()), points
    assert any(points[b] == {1} for b in points if b > 0), points  # the next lead saved while group 0 was away
    assert [c.batch for c in result.checkpoints] == got[-2:], result.checkpoints
    checkpoints = os.path.dirname(result.checkpoints[-1].url.rstrip("/")).replace("file://", "")
    left = {n for n in os.listdir(checkpoints) if os.path.isdir(os.path.join(checkpoints, n))}
    assert left == {c.url.rstrip("/").rsplit("/", 1)[1] for c in result.checkpoints}, left
    _check_evals(result, folder, local_evals, points, kills)
    _resume_by_name(tmp_path, data, result)


def _check_evals(result, folder: str, local: dict, points: dict, kills: list) -> None:
    """Through both kills, at every eval point: every worker of every group alive there logged its group's metrics of
    the whole eval set (its part synced over its group), the same in every group, and equal (float tolerance) to an
    uninterrupted local run's at that batch; each save point's history entry carries them at its Timestamp (the
    saves group 1 made while group 0 was away included); and the 9th checkpoint's asynchronous validation (a Ray
    task that resharded the lead's 2-rank checkpoint to one process) has the same metrics at the same Timestamp."""
    evals: dict = {}
    for path in glob.glob(os.path.join(folder, "evals-*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            evals.setdefault(record["batch"], []).append(record)
    eval_points = list(range(SAVE_EVERY, BATCHES * EPOCHS, SAVE_EVERY))
    assert set(eval_points) <= set(evals) and set(eval_points) <= set(local), (sorted(evals), sorted(local))
    for batch in eval_points:
        for r in evals[batch]:  # each group's metrics of the whole set (an uncommitted step may evaluate it again)
            values = {k: v for k, v in r["metrics"].items() if k.startswith("metrics/val/")}
            assert set(values) == {"metrics/val/accuracy", "metrics/val/cross_entropy"} == set(local[batch]), r
            assert values == pytest.approx(local[batch], rel=1e-5, abs=1e-7), (batch, r, local[batch])
    saved = {int(e["time/batch"]): e for e in result.history if e.get("checkpoint_path")}
    # Each eval point's save (at its batch, or a few batches late: see the save points above) carries its metrics.
    saved_for = {p: min((b for b in saved if p <= b < p + SAVE_EVERY), default=None) for p in eval_points}
    assert None not in saved_for.values(), (saved_for, sorted(saved))
    for batch in eval_points:
        entry = saved[saved_for[batch]]
        assert {k: entry[k] for k in local[batch]} == pytest.approx(local[batch], rel=1e-5, abs=1e-7), (batch, entry)
    away = [b for b in points if points[b] == {1} and b < BATCHES * EPOCHS]  # saved by group 1 while group 0 was away
    assert away and all("metrics/val/accuracy" in saved[b] for b in away), (away, sorted(saved))
    ordered = [saved[b] for b in sorted(saved) if not saved[b].get("checkpoint_lost")]  # a late save takes its place
    chosen = ordered[VALIDATE_EVERY - 1]
    [validation] = result.validations
    assert validation["validation"] == "async", validation
    assert validation["validated_checkpoint"] == chosen["checkpoint_path"].rstrip("/").rsplit("/", 1)[1]
    assert validation["time/batch"] == chosen["time/batch"] == saved_for[VALIDATE_EVERY * SAVE_EVERY], validation
    for name in ("accuracy", "cross_entropy"):
        assert validation[f"metrics/val_async/{name}"] == pytest.approx(chosen[f"metrics/val/{name}"], rel=1e-5)
    print(f"eval points: {len(eval_points)}, kills at {[round(k['t']) for k in kills]}")


def _resume_by_name(tmp_path, data: str, first) -> None:
    """A whole-run restart: the same run (name, storage) fitted again for one more epoch, a new worker group of
    2 groups x 2 workers, now with tensor parallelism inside each group (``FSDPConfig(tensor_parallel=2)``: each
    group's 2 workers one tensor group, the model's layers split over them; torchft across the groups). Every worker
    of the first quorum's groups loads the lead group's newest 2-rank FSDP checkpoint (resharded to its TP shards; a
    group that joins later heals from a live group's same-position TP shards), the run trains epoch ``EPOCHS`` alone,
    each global batch's rows once per tensor group (both its ranks the same rows), and ends with the uninterrupted
    run's Timestamp and parameters at ``EPOCHS + 1`` epochs, in every group and in its final checkpoint."""
    import torch

    folder = str(tmp_path / "rec-resumed")
    os.makedirs(folder)
    with open(os.path.join(folder, "done"), "w"):  # no kills: unpaced steps
        pass
    result = _trainer(tmp_path, data, folder, epochs=EPOCHS + 1, tensor_parallel=GROUP_SIZE, evaluate=False).fit()
    assert (int(result.timestamp.epoch), int(result.timestamp.batch)) == (EPOCHS + 1, BATCHES * (EPOCHS + 1))
    finals = [torch.load(p, weights_only=False) for p in glob.glob(os.path.join(folder, "final-*.pt"))]
    assert sorted((f["group"], f["position"]) for f in finals) == [(0, 0), (0, 1), (1, 0), (1, 1)], finals
    # The groups of the run's first quorum load the newest checkpoint from storage; a group that joins after the
    # first step committed heals from a live group instead (its storage copy would be older than the peer's state).
    from_storage = {f["group"] for f in finals if f["loaded"] == "storage"}
    described = [(f["group"], f["position"], f["loaded"], f["healed"]) for f in finals]
    assert from_storage and all(f["loaded"] == "storage" or f["healed"] >= 1 for f in finals), described
    assert all(f["loaded"] == "storage" for f in finals if f["group"] in from_storage), described  # whole groups
    loads = [json.loads(line)["loaded"] for p in glob.glob(os.path.join(folder, "loads-*.jsonl")) for line in open(p)]
    # the first run's final checkpoint, on every worker that read storage
    assert sorted(x for x in loads if x is not None) == [BATCHES * EPOCHS] * GROUP_SIZE * len(from_storage), loads
    assert min(r["batch"] for r in read_records(folder)) == BATCHES * EPOCHS + 1, "the run did not resume at its end"
    _check_rows(folder, range(EPOCHS, EPOCHS + 1), tensor_parallel=GROUP_SIZE)
    reference = dict(_uninterrupted(data, EPOCHS + 1).named_parameters())
    for final in finals:  # each worker's parameters put together over its group's mesh
        for name, value in reference.items():
            whole = final["full"][name]
            assert torch.allclose(whole, value.detach(), atol=1e-5), (final["group"], name, (whole - value).abs().max())
    # tensor parallelism really split the layers: position 0 holds the first layer's first 4 output rows only
    assert all(f["shards"]["module.0.weight"].shape == (4, 4) for f in finals), [f["shards"].keys() for f in finals]
    _check_checkpoint(result, reference, tmp_path, EPOCHS + 1)
    assert result.checkpoints[-1].url != first.checkpoints[-1].url
