"""Restart-based recovery vs replica groups under the same seeded kill plan: goodput and time lost per failure.

The same small job runs twice on one local Ray (3 CPU workers, the resume tests' 203-row Parquet set, global
batch 12, steps paced to ``--step-s`` between backward and the all-reduce, so a step costs what it would on a GPU
rather than what this CPU does, and a kill lands mid-step as it would there):

* ``restart``: the default recovery. A killed worker fails the whole worker group; Ray restarts it and every
  rank reloads the newest checkpoint (saved every ``--save-every`` batches) and trains the batches since again;
* ``replica_groups``: ``fault_tolerance="replica_groups"`` (3 torchft replica groups). Ray restarts the killed
  group alone; the other two keep committing, and the group rejoins from a healthy peer.

The kill plan is drawn once from ``--seed``: ``--kills`` SIGKILLs, each of a worker of the rank (group) drawn,
each after a pause drawn from ``--pause A B`` seconds once the previous victim's replacement trains again.
Both modes keep the same checkpoint interval (replica groups keep storage checkpoints for whole-run loss).

Per mode: the wall time from the first step's end to the last's, the median step (gaps between a process's
consecutive steps), ideal = batches of the run x median step, goodput = ideal / wall, and the time lost per
failure = (wall - ideal) / kills; then the restart-to-replica ratio of the time lost per failure. Both runs
must end with the same Timestamp (checked). Numbers on a loaded machine are noisy: compare within one run.
Replica groups also get the time lost split by cause (`per_failure`, from each surviving process's commits and
quorum changes): ``at_failure`` (from its last commit before the kill to its first commit in the smaller quorum,
less one step) and ``at_rejoin`` (the gap around the quorum change back to all groups, less one step), medians
over kills and survivors, in seconds and steps; ``detect_s`` (the kill to the smaller quorum's call returning)
and ``quorum_call_s`` (that call's length: the Lighthouse's wait plus re-forming the process group).

    PYTHONPATH=$PWD python bench/replica_vs_restart.py                      # short: 3 kills, 8-15 s apart
    PYTHONPATH=$PWD python bench/replica_vs_restart.py --epochs 40 --kills 20 --pause 45 120   # the long plan
    PYTHONPATH=$PWD python bench/replica_vs_restart.py --groups 3 4 6 --modes replica_groups   # per group count

``--groups``: the run is repeated for each number of workers (replica groups) given, on one Ray instance, with
the kill plan drawn for each count; a table at the end gives, per count and mode, the goodput, the time lost per
failure and (replica groups) its part at the failure, in seconds and steps, against the heartbeat detection. At 4
groups and more a kill leaves a survivor that is not the victim's ring neighbour in gloo's all-reduce: the count
where, before `ray/replica_abort.py`, a failure cost gloo's whole timeout (30 s) instead of a step or two.

``restart_local`` (a mode): restarts with each save also kept in the node's local tier
(``CheckpointConfig(local_dir=..., local_keep=2)``). For the restart modes each process's checkpoint read at a
restart is timed (`Checkpointer.load`: found, read, verified, applied) with the files each tier served, and the
median is printed beside the other restart mode's, so one run has the restart's read time with and without the
tier. ``--storage s3`` puts the run (and its checkpoints) on a local S3 server (moto, as ``bench/local_tier.py``)
instead of a local folder, and ``--state-mb N`` adds N MiB of frozen parameters to the model, so a read is large
enough to matter (nothing more to compute or all-reduce per step)::

    PYTHONPATH=$PWD python bench/replica_vs_restart.py --groups 2 --modes restart,restart_local --kills 2 \
        --epochs 4 --storage s3 --state-mb 64 --pause 5 8

``--group-size K`` (above 1): sharded replica groups against restarts of the same sharded run. Each count of
``--groups`` G runs G x K workers: ``replica_groups`` is ``RayTrainer(fault_tolerance="replica_groups",
replica_group_size=K, parallelism=FSDPConfig())`` (FSDP2 inside each group of K, torchft across the G groups: a
kill of any worker replaces its group alone, which heals its shards from a live group's); ``restart`` is FSDP over
all G x K workers with ``fault_tolerance=None`` (a kill restarts the whole run from its newest checkpoint). The
kill plan draws a world rank (any worker of any group); the time lost at a failure is measured on the other
groups' workers. ``--repeats N`` runs each mode N times (the modes interleaved) and prints each metric's median and
range over the repeats, and the ratio of the medians::

    PYTHONPATH=$PWD python bench/replica_vs_restart.py --groups 2 --group-size 2 --kills 2 --epochs 4 --repeats 2

Grows with scale as: restart: (restart + reload from storage + the batches since the last save) per failure,
whatever the world size; replica groups: the heartbeat timeout (0.5 s) plus the one step in flight per failure,
and per rejoin one peer-to-peer transfer of the model and optimizer (see docs/operating.md, "Replica groups").
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Tuple

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.checkpoint_io import s3_server  # noqa: E402
from raytrain_events import Callback  # noqa: E402
from tests import resume_helpers as h  # noqa: E402
from tests.ray.fault_tolerance.replica_helpers import live_procs  # noqa: E402


def _record_loads(folder: str) -> None:
    """In this worker process: one ``loads-<pid>.jsonl`` line per `Checkpointer.load` (a restart's read of its
    checkpoint: found, read, verified, applied), with its seconds and the files each tier served (bench-only
    instrumentation, installed before the worker builds its `Trainer`, which loads)."""
    from raytrain_events.checkpoint.run.checkpointer import Checkpointer

    real = Checkpointer.load
    if getattr(real, "_bench", False):
        return

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        info = real(self, *args, **kwargs)
        if info is not None:
            local = getattr(self, "loaded_local", None)
            line = {"t": time.time(), "load_s": time.perf_counter() - t, "batch": int(info.timestamp.get("batch", 0))}
            line["local_files"] = [] if local is None else list(local.local)
            line["storage_files"] = [] if local is None else sorted(local.storage)
            with open(os.path.join(folder, f"loads-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
        return info

    load._bench = True  # type: ignore[attr-defined]
    Checkpointer.load = load  # type: ignore[method-assign]


class Steps(Callback):
    """Per process: a proc file at the start and one line per step end (committed or not, the quorum's groups) and
    per quorum change (``on_quorum_change``: before, after, when its quorum call began and ended); each step paced
    to ``step_s`` between its backward and its all-reduce (where a GPU spends a step's time). Built in the worker
    before its `Trainer`: it times the checkpoint loads there (`_record_loads`)."""

    def __init__(self, folder: str, step_s: float, groups: int) -> None:
        self.folder, self.step_s, self.groups = folder, step_s, groups
        _record_loads(folder)

    def fit_start(self, state, logger) -> None:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        with open(os.path.join(self.folder, f"proc-{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "rank": rank, "t": time.time()}, f)
        self.file = open(os.path.join(self.folder, f"steps-{os.getpid()}.jsonl"), "a")
        self.commit = next((c for c in state.callbacks if type(c).__name__ == "ReplicaCommit"), None)
        self.quorum_call = [0.0, 0.0]  # when the last quorum call began and ended
        if self.commit is not None:
            manager, calls = self.commit.loader.manager, self.quorum_call
            start_quorum = manager.start_quorum

            def timed_quorum(*args: Any, **kwargs: Any) -> Any:
                calls[0] = time.time()
                try:
                    return start_quorum(*args, **kwargs)
                finally:
                    calls[1] = time.time()

            manager.start_quorum = timed_quorum

    def on_quorum_change(self, state, logger, change) -> None:
        line = {"quorum": [change.before, change.after], "t": time.time(), "call": list(self.quorum_call)}
        self.file.write(json.dumps(line) + "\n")

    def after_train_batch(self, state, logger) -> None:
        time.sleep(self.step_s)  # the step's compute, before its all-reduce: a kill lands mid-step, as on a GPU

    def batch_end(self, state, logger) -> None:
        committed = True if self.commit is None else bool(self.commit.optimizer.committed)
        groups = self.groups if self.commit is None else self.commit.loader.participants
        line = {"t": time.time(), "batch": int(state.timestamp.batch), "committed": committed, "groups": groups}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def _lines(folder: str) -> Dict[int, List[Dict[str, Any]]]:
    out = {}
    for path in glob.glob(os.path.join(folder, "steps-*.jsonl")):
        with open(path) as f:
            out[int(path.rsplit("-", 1)[1].split(".")[0])] = [json.loads(line) for line in f if line.strip()]
    return out


def _steps(folder: str) -> Dict[int, List[Dict[str, Any]]]:
    """Per process, its step ends."""
    return {pid: [x for x in xs if "batch" in x] for pid, xs in _lines(folder).items()}


def _gap(commits: List[float], t: float, median: float) -> float:
    """Time lost around ``t``: the gap from the last commit before ``t`` to the first after it, less one step."""
    before = [c for c in commits if c <= t]
    after = [c for c in commits if c > t]
    return (after[0] - before[-1] - median) if before and after else float("nan")


def _ranks(folder: str) -> Dict[int, int]:
    """Each process's world rank (its proc file)."""
    out = {}
    for path in glob.glob(os.path.join(folder, "proc-*.json")):
        with open(path) as f:
            proc = json.load(f)
        out[int(proc["pid"])] = int(proc["rank"])
    return out


def per_failure(folder: str, kills: List[Tuple[float, int]], median: float, group_size: int = 1) -> Dict[str, Any]:
    """Replica groups, per kill and surviving process: the time lost at the failure (from the last commit before
    the kill to the first commit of the smaller quorum, less one step) and at the replaced group's rejoin (the gap
    around the quorum change back to all groups, less one step); medians over kills and survivors, in seconds and
    steps. ``detect_s``: kill to the smaller quorum's call returning (Lighthouse wait + re-forming the process group);
    ``quorum_call_s``: that call's own length."""
    lines, ranks = _lines(folder), _ranks(folder)
    at_failure, at_rejoin, detect, call = [], [], [], []
    for t_kill, victim in kills:
        group = ranks.get(victim, -1) // group_size
        for pid, xs in lines.items():
            if pid == victim or ranks.get(pid, -1) // group_size == group:
                continue  # the victim's group (its workers are replaced with it)
            commits = [x["t"] for x in xs if "batch" in x and x["committed"]]
            if not commits or commits[0] > t_kill or commits[-1] < t_kill:
                continue  # not alive across the kill
            changes = [x for x in xs if "quorum" in x and x["t"] > t_kill]
            left = next((c for c in changes if c["quorum"][1] < c["quorum"][0]), None)
            if left is None:
                continue
            after = [c for c in commits if c > left["t"]]
            before = [c for c in commits if c <= t_kill]
            if after and before:
                at_failure.append(after[0] - before[-1] - median)
            detect.append(left["call"][1] - t_kill)
            call.append(left["call"][1] - left["call"][0])
            back = next((c for c in changes if c["t"] > left["t"] and c["quorum"][1] > c["quorum"][0]), None)
            if back is not None:
                at_rejoin.append(_gap(commits, back["t"], median))

    def med(xs: List[float]) -> Any:
        xs = [x for x in xs if x == x]
        return round(statistics.median(xs), 2) if xs else None

    out = {"at_failure_s": med(at_failure), "at_rejoin_s": med(at_rejoin), "detect_s": med(detect)}
    out["quorum_call_s"] = med(call)
    for key in ("at_failure", "at_rejoin"):
        value = out[f"{key}_s"]
        out[f"{key}_steps"] = None if value is None else round(value / median, 1)
    out["samples"] = len(at_failure)
    out["each"] = {
        name: [round(x, 2) for x in xs]
        for name, xs in (
            ("at_failure_s", at_failure),
            ("at_rejoin_s", at_rejoin),
            ("detect_s", detect),
            ("call_s", call),
        )
    }
    return out


def restart_reads(folder: str) -> Dict[str, Any]:
    """Restarts: every process's checkpoint load after the first start (a restart reads the newest checkpoint):
    the median and range of its seconds, and how many of its payload files came from the local tier."""
    loads = []
    for path in glob.glob(os.path.join(folder, "loads-*.jsonl")):
        with open(path) as f:
            loads += [json.loads(line) for line in f if line.strip()]
    if not loads:
        return {"restart_reads": 0}
    secs = [x["load_s"] for x in loads]
    return {
        "restart_reads": len(loads),
        "read_s": round(statistics.median(secs), 3),
        "read_s_range": [round(min(secs), 3), round(max(secs), 3)],
        "files_local": sum(len(x["local_files"]) for x in loads),
        "files_storage": sum(len(x["storage_files"]) for x in loads) if any(x["local_files"] for x in loads) else None,
    }


def _live(folder: str, rank: int) -> Any:
    """The newest live process of ``rank`` that has trained 2 steps, or None."""
    steps = _steps(folder)
    alive = [p for p in live_procs(folder) if p["rank"] == rank and len(steps.get(p["pid"], [])) >= 2]
    return max(alive, key=lambda p: p["t"]) if alive else None


def _chaos(
    folder: str, workers: int, plan: List[Tuple[float, int]], done: List[Tuple[float, int]], stop: threading.Event
) -> None:
    """Kill per plan: each pause counts from when every rank (all ``workers``) trains again after the previous
    kill."""
    killed: set = set()
    for pause, rank in plan:
        ready = None
        while not stop.is_set():
            proc = _live(folder, rank)
            # every rank trains (after a whole-group restart, all are new processes)
            if proc is not None and proc["pid"] not in killed and all(_live(folder, r) for r in range(workers)):
                ready = ready or time.time()
                if time.time() - ready >= pause:
                    os.kill(proc["pid"], signal.SIGKILL)
                    killed.add(proc["pid"])
                    done.append((time.time(), proc["pid"]))
                    break
            time.sleep(0.1)


def _model(state_mb: int) -> Any:
    """The resume tests' model, plus ``state_mb`` MiB of frozen parameters: what a checkpoint (and a restart's read)
    carries without changing the step (no gradient, nothing all-reduced; DDP broadcasts it once at the wrap)."""
    import torch

    model = h.make_model()
    if state_mb:
        model.ballast = torch.nn.Parameter(torch.zeros(state_mb * 2**18), requires_grad=False)
    return model


def run(  # noqa: PLR0913
    mode: str, groups: int, args: argparse.Namespace, data: str, plan: List[Tuple[float, int]], storage: Tuple[str, Any]
) -> Dict[str, Any]:
    import functools

    import ray.data

    from raytrain_events import CheckpointConfig, FSDPConfig, RayTrainer

    size = args.group_size
    workers = groups * size
    folder = tempfile.mkdtemp(prefix=f"bench-{mode}-{groups}x{size}-")
    root, options = storage
    # groups of several workers: FSDP inside each group (replica groups), or over all the workers (restarts)
    sharded = {"parallelism": FSDPConfig(), "resources_per_worker": {"CPU": 0.5}} if size > 1 else {}
    if size > 1 and mode == "replica_groups":
        sharded["replica_group_size"] = size
    # restart_local: restarts, each save also kept in this node's local tier (`CheckpointConfig(local_dir=...)`)
    local = {"local_dir": os.path.join(folder, "nvme"), "local_keep": 2} if mode == "restart_local" else {}
    kills: List[Tuple[float, int]] = []
    stop = threading.Event()
    chaos = threading.Thread(target=_chaos, args=(folder, workers, plan, kills, stop), daemon=True)
    chaos.start()
    started = time.time()
    try:
        result = RayTrainer(
            model=functools.partial(_model, args.state_mb),
            optimizers=h.make_sgd,
            datasets={"train": ray.data.read_parquet(data)},
            max_duration=f"{args.epochs}ep",
            batch_size=h.GLOBAL_BATCH // workers,
            num_workers=workers,
            **sharded,
            fault_tolerance="replica_groups" if mode == "replica_groups" else None,
            max_failures=2 * len(plan) + 2,
            callbacks=lambda: [Steps(folder, args.step_s, groups)],
            checkpoint=CheckpointConfig(
                save_interval=f"{args.save_every}ba", keep=2, save_every_n_seconds=None, **local
            ),
            report_every_s=5.0,
            storage_path=f"{root}/{os.path.basename(folder)}" if root else os.path.join(folder, "runs"),
            storage_options=options,
            run_name=f"{mode}-{groups}x{size}",
            seed=0,
            progress_bar=False,
        ).fit()
    finally:
        stop.set()
        chaos.join(timeout=10)
    steps = _steps(folder)
    times = [s["t"] for rs in steps.values() for s in rs]
    gaps = [b["t"] - a["t"] for rs in steps.values() for a, b in zip(rs, rs[1:]) if b["batch"] == a["batch"] + 1]
    median = statistics.median(gaps)
    batches = int(result.timestamp.batch)
    wall = max(times) - min(times)
    ideal = batches * median
    return {
        "mode": mode,
        "groups": groups,
        "group_size": size,
        "timestamp": {"epoch": int(result.timestamp.epoch), "batch": batches, "sample": int(result.timestamp.sample)},
        "kills": len(kills),
        "fit_s": round(time.time() - started, 1),
        "wall_s": round(wall, 1),
        "median_step_s": round(median, 3),
        "ideal_s": round(ideal, 1),
        "goodput": round(ideal / wall, 3),
        "lost_per_failure_s": round((wall - ideal) / max(len(kills), 1), 1),
        "steps_trained": sum(len(rs) for rs in steps.values()),  # every step end of any process (redone ones too)
        **(per_failure(folder, kills, median, size) if mode == "replica_groups" else restart_reads(folder)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--pause", type=float, nargs=2, default=(8.0, 15.0))
    parser.add_argument("--step-s", type=float, default=0.3)
    parser.add_argument("--save-every", type=int, default=10, help="batches between checkpoints (both modes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="restart,replica_groups")
    parser.add_argument("--groups", type=int, nargs="+", default=[3], help="workers (replica groups), one run each")
    parser.add_argument("--state-mb", type=int, default=0, help="MiB of frozen parameters added to the checkpoint")
    parser.add_argument(
        "--storage", choices=("local", "s3"), default="local", help="the run's storage: a local folder or S3 (moto)"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="workers per replica group: above 1, FSDP inside each group (replica groups) against restarts of "
        "FSDP over all the workers",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode (medians and ranges printed)")
    args = parser.parse_args()
    bad = [g for g in args.groups if g < 2 or h.GLOBAL_BATCH % (g * args.group_size)]
    if bad or args.group_size < 1:
        parser.error(
            f"--groups {bad} --group-size {args.group_size}: each count must be >= 2 and groups x group size must "
            f"divide the global batch ({h.GLOBAL_BATCH})"
        )
    import ray

    from raytrain_events.ray.embedded import own_state_api

    kwargs = dict(num_cpus=max(args.groups) * args.group_size + 1, include_dashboard=False, log_to_driver=False)
    with own_state_api(kwargs):  # Train's cleaner asks no other Ray on the machine (a false "controller dead")
        ray.init(address="local", **kwargs)
    data = tempfile.mkdtemp(prefix="bench-data-")
    h.write_parquet(data)
    with contextlib.ExitStack() as stack:
        storage = stack.enter_context(s3_server()) if args.storage == "s3" else ("", {})
        table = _runs(args, data, storage)
    _print_table(table)


def _spread(results: List[Dict[str, Any]], key: str) -> Tuple[float, float, float]:
    """The median, min and max of ``key`` over the repeats."""
    values = [r[key] for r in results]
    return statistics.median(values), min(values), max(values)


def _side_by_side(label: str, restart: List[Dict[str, Any]], replicas: List[Dict[str, Any]]) -> None:
    """Restarts against replica groups over the repeats: goodput and time lost per failure, medians [ranges], and
    the ratio of the medians."""
    for a, b in zip(restart, replicas):
        assert a["timestamp"] == b["timestamp"], (a["timestamp"], b["timestamp"])
    rg, rl = _spread(restart, "goodput"), _spread(restart, "lost_per_failure_s")
    pg, pl = _spread(replicas, "goodput"), _spread(replicas, "lost_per_failure_s")
    print(
        f"{label}: goodput: restart {rg[0]:.2f} [{rg[1]:.2f}-{rg[2]:.2f}], replica groups {pg[0]:.2f} "
        f"[{pg[1]:.2f}-{pg[2]:.2f}] ({pg[0] / max(rg[0], 1e-9):.1f}x); time lost per failure: restart "
        f"{rl[0]:.1f} s [{rl[1]:.1f}-{rl[2]:.1f}], replica groups {pl[0]:.1f} s [{pl[1]:.1f}-{pl[2]:.1f}] "
        f"({rl[0] / max(pl[0], 1e-9):.1f}x less); {len(replicas)} run(s) each",
        flush=True,
    )
    at = [r["at_failure_steps"] for r in replicas if r.get("at_failure_steps") is not None]
    detect = [r["detect_s"] for r in replicas if r.get("detect_s") is not None]
    if at and detect:
        steps = [r["median_step_s"] for r in replicas]
        print(
            f"{label}: replica groups at the failure: {statistics.median(at):.1f} steps [{min(at)}-{max(at)}] of "
            f"{statistics.median(steps):.3f} s, detection {statistics.median(detect):.2f} s "
            f"[{min(detect):.2f}-{max(detect):.2f}]",
            flush=True,
        )


def _runs(args: argparse.Namespace, data: str, storage: Tuple[str, Any]) -> List[Dict[str, Any]]:
    table = []
    size = args.group_size
    for groups in args.groups:
        rng = random.Random(args.seed)
        plan = [(rng.uniform(*args.pause), rng.randrange(groups * size)) for _ in range(args.kills)]
        label = f"{groups} groups" + (f" x {size} FSDP workers" if size > 1 else "")
        print(f"{label}: kill plan (pause s, rank): {[(round(p, 1), r) for p, r in plan]}", flush=True)
        by_mode: Dict[str, List[Dict[str, Any]]] = {}
        for _ in range(args.repeats):  # the modes interleaved, so a change of load falls on both
            for mode in args.modes.split(","):
                result = run(mode, groups, args, data, plan, storage)
                print(json.dumps(result), flush=True)
                by_mode.setdefault(mode, []).append(result)
                table.append(result)
        if "restart" in by_mode and "restart_local" in by_mode:
            plain, tier = by_mode["restart"][0], by_mode["restart_local"][0]
            if plain.get("read_s") and tier.get("read_s"):
                print(
                    f"{label}: a restart's checkpoint read: storage {plain['read_s']:.2f} s, local tier "
                    f"{tier['read_s']:.2f} s ({plain['read_s'] / tier['read_s']:.1f}x); files from the local tier "
                    f"{tier['files_local']}, from storage {tier['files_storage']}",
                    flush=True,
                )
        if "restart" in by_mode and "replica_groups" in by_mode:
            _side_by_side(label, by_mode["restart"], by_mode["replica_groups"])
    return table


def _print_table(table: List[Dict[str, Any]]) -> None:
    from raytrain_events.ray.replica_checks import HEARTBEAT_TIMEOUT_MS

    print(
        f"\ngroups  mode            goodput  lost/failure s  at failure s (steps)  detect s   [heartbeat {HEARTBEAT_TIMEOUT_MS} ms]"
    )
    for r in table:
        at = "-" if r.get("at_failure_s") is None else f"{r['at_failure_s']:.2f} ({r['at_failure_steps']})"
        detect = "-" if r.get("detect_s") is None else f"{r['detect_s']:.2f}"
        print(
            f"{r['groups']:>3}x{r['group_size']:<2}  {r['mode']:<14}  {r['goodput']:>7.2f}  {r['lost_per_failure_s']:>14.1f}  {at:>20}  {detect:>8}"
            + ("" if not r.get("read_s") else f"  restart read {r['read_s']:.2f} s x{r['restart_reads']}")
        )


if __name__ == "__main__":
    main()
