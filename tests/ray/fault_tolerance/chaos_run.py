"""A chaos soak: an elastic run on a 3-node ``ray.cluster_utils.Cluster`` while failures keep coming.

The run trains ``num_workers=(1, 3)`` (one worker per node, a ``slot`` resource each) with periodic
checkpoints, the progress watchdog and the preemption guard. The main thread (Ray's
``Cluster.add_node`` installs signal handlers, which Python allows only there) injects failures of
our own, one at a time, each after the current group has trained a few batches and a random pause:

* ``kill``: SIGKILL a random worker process (Ray restarts the group from the newest checkpoint);
* ``hang``: SIGSTOP a random worker process (no rank progresses: the watchdog dumps, names it and
  ends the group; Ray restarts it without the stopped process);
* ``notice``: drain a node that hosts a worker as a preemption with a deadline (``ray drain-node``,
  as a cloud's autoscaler does): the ranks save at the next batch; once Ray has moved the group
  off it (or the deadline passed) the node is removed, as the cloud would;
* ``remove`` / ``add``: a node that hosts a worker goes away without notice / a node comes back.

A plan is a fixed list or ``random:N`` (N random kinds, for the opt-in long soak). The CI plan,
``remove,hang,notice,add``, takes the group from 3 workers to 2 (a node lost), restarts it at 2 (a
hang), to 1 (a preemption) and back to 2 (a node added): a worker killed without its node is the
restart path of ``remove`` and of the resume tests. Chaos stops by itself: after its plan, or when its time
budget runs out, and never with fewer than one node left to train on. At the end the run must
equal an uninterrupted one: the exact global Timestamp, every row once per epoch. Prints one JSON
line (``CHAOS_RESULT``) with the events, the result and the goodput summary.

    python tests/ray/fault_tolerance/chaos_run.py <scratch dir> [--plan remove,hang,notice,add] [--epochs 4]
        [--seed 0] [--pause 1 3] [--budget-s 900]

The long soak, opt-in (a random event every 45-120 s for about an hour, 30 epochs):

    python tests/ray/fault_tolerance/chaos_run.py /tmp/soak --plan random:40 --epochs 30 --pause 45 120 --budget-s 3600
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")  # Ray's drain poll (default 5 s)
# A node removed without notice is declared dead by the GCS after 5 failed health checks, one per period
# (Ray's default 3 s: 15 s; 5 s here). The raylet is gone, so each check fails at once (a refused
# connection); a live raylet still has each check's own 10 s to answer (``health_check_timeout_ms``).
# Ray Train's elastic policy reads the nodes through Ray Data's autoscaling coordinator, which refreshes
# them every 20 s: a refresh after the death sees it.
os.environ.setdefault("RAY_health_check_period_ms", "1000")
# Until then Ray sizes the next group for the lost node too, and waits this long for its placement group
# before it decides again (60 s by default; 30 s, then 12 s here before, waited out in full at each node loss and
# at the notice, whose node is still alive until it goes). It bounds only that wait (`WorkerGroup`'s
# ``pg_handle.wait``): a group whose slots exist is placed at once (tens of ms seen at load 50).
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "6")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # four raylets starting on a loaded machine
# Ray Data's autoscaling coordinator (the elastic policy's view of the nodes) re-reads the cluster every
# `NODE_VIEW_TICK_S` here instead of every 20 s (`_fast_node_view`): after a node loss the stale view had Ray
# size the next group for the lost node, wait out the start timeout above and decide again (twice: 24 s seen),
# and a node added waited up to a tick before the group grew.
NODE_VIEW_TICK_S = 2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: resume_helpers.py

import resume_helpers as h  # noqa: E402

from raytrain_events import Callback  # noqa: E402
from raytrain_events.core.logger import LoggerDestination  # noqa: E402

KINDS = ("kill", "hang", "notice", "remove", "add")
MAX_NODES = 3  # the head and two worker nodes, one train worker each
NOTICE_DEADLINE_S = 15


class Beacon(Callback):
    """Each rank's process, node and progress, for the chaos thread to pick its targets and pace;
    and the run's pace: ``sleep_s`` per batch (``alone_sleep_s`` on one worker) until the chaos is
    over (``<folder>/chaos-done``), so that the run outlasts the plan however slow the restarts."""

    def __init__(self, folder: str, sleep_s: float, alone_sleep_s: float) -> None:
        self.folder, self.sleep_s, self.alone_sleep_s = folder, sleep_s, alone_sleep_s
        self.done = os.path.join(folder, "chaos-done")

    def fit_start(self, state, logger) -> None:
        import ray

        self.path = os.path.join(self.folder, f"proc-{os.getpid()}.json")
        self.info = {
            "pid": os.getpid(),
            "rank": state.rank,
            "world": state.world_size,
            "node": ray.get_runtime_context().get_node_id(),
            "t": time.time(),
            "batch": int(state.timestamp.batch),
        }
        self._write()

    def batch_end(self, state, logger) -> None:
        self.info["batch"], self.info["beat"] = int(state.timestamp.batch), time.time()
        self._write()
        if not os.path.exists(self.done):
            time.sleep(self.alone_sleep_s if state.world_size == 1 else self.sleep_s)

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.info, f)
        os.replace(tmp, self.path)


class FirstReports(LoggerDestination):
    """A driver logger: when each worker group's first report reached the driver (its history entry, the
    one with ``resumed_from_batch``). The history knows a group only by its reports: a group that failed
    before its first one has no attempt of its own (the controller's failure record still counts it and names
    its cause: `raytrain_events.ray.reports.failures`). So that each event is one restart of its own, the chaos
    acts on a group only once the driver has its first report (`Chaos._wait_for_training`)."""

    def __init__(self) -> None:
        self.arrived: List[float] = []  # wall times, in order (list.append: safe across the two threads)

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        if "resumed_from_batch" in metrics:
            self.arrived.append(time.time())

    def since(self, started: float) -> bool:
        """A first report arrived after ``started`` (a group's start: the previous group's first report
        came before it, a restart's seconds earlier)."""
        return any(t >= started for t in self.arrived)


def _fast_node_view() -> None:
    """Every Ray worker process of the soak's job (``worker_process_setup_hook``): the autoscaling coordinator's
    cluster view refreshes every `NODE_VIEW_TICK_S` (its ``TICK_INTERVAL_S``, a class attribute Ray 2.60 reads at
    each tick; a test-only speed-up of the waits, not of anything the soak checks)."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S = NODE_VIEW_TICK_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a stopped (SIGSTOP) process is no target any more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("T", "Z", "X")
    except OSError:
        return False


def current_group(folder: str) -> List[Dict[str, Any]]:
    """The newest group's live processes (one entry per rank), or [] while none trains."""
    procs = []
    for path in glob.glob(os.path.join(folder, "proc-*.json")):
        try:
            with open(path) as f:
                procs.append(json.load(f))
        except (OSError, ValueError):
            continue
    procs = [p for p in procs if _alive(p["pid"])]
    if not procs:
        return []
    newest = max(p["t"] for p in procs)
    group = [p for p in procs if p["t"] > newest - 30]
    return group if len(group) == group[0]["world"] else []


class Chaos:
    """Failure injection, one event at a time, bounded in count and time (see the module doc)."""

    def __init__(
        self,
        cluster,
        nodes,
        scratch,
        run_dir,
        reports: FirstReports,
        plan: List[str],
        seed: int,
        pause,
        budget_s: float,
    ):
        self.cluster, self.nodes, self.run_dir, self.reports = cluster, nodes, run_dir, reports
        self.procs = os.path.join(scratch, "procs")
        self.plan, self.rng, self.pause = plan, random.Random(seed), pause
        self.deadline = time.monotonic() + budget_s
        self.events: List[Dict[str, Any]] = []
        self.stopped: List[int] = []  # SIGSTOPped pids, continued at the end if Ray left any
        self.first_batch: Dict[tuple, int] = {}  # per group (its pids): the batch it was first seen at

    def run(self, done: threading.Event) -> None:
        # The chaos starts on the full group: on a loaded machine Ray may start the elastic group below its
        # size (a placement not ready within the start timeout) and grow it at its next resize check.
        self._wait_for_growth(done, MAX_NODES - 1)
        for kind in self.plan:
            # An event waits for a training group (not one being restarted) and is retried until it lands.
            while True:
                group = self._wait_for_training(done, batches=2)
                if group is None:
                    return
                time.sleep(self.rng.uniform(*self.pause))
                group = current_group(self.procs)
                event = getattr(self, "_" + kind)(group) if group and not done.is_set() else None
                if event is not None:
                    self.events.append(dict(event, kind=kind, at=time.time()))
                    print("CHAOS", json.dumps(self.events[-1]), flush=True)
                    break
        if self.events and self.events[-1]["kind"] == "add" and "skipped" not in self.events[-1]:
            self._wait_for_growth(done, self.events[-1]["world"])

    def _wait_for_growth(self, done: threading.Event, world: int) -> None:
        """After a node came back: until Ray has grown the group past ``world`` and it trains."""
        while not done.is_set() and time.monotonic() < self.deadline:
            group = self._wait_for_training(done, batches=1)
            if group is None or len(group) > world:
                return
            time.sleep(0.5)

    def finish(self) -> None:
        """The chaos is over: the run goes on at full speed (see `Beacon`)."""
        with open(os.path.join(self.procs, "chaos-done"), "w") as f:
            f.write(str(time.time()))

    def _wait_for_training(self, done: threading.Event, batches: int) -> Optional[List[Dict[str, Any]]]:
        """The current group once it has trained ``batches`` since it started and the driver has its first report
        (else the goodput report would not know the group: see `FirstReports`); None when out of time."""
        while not done.is_set() and time.monotonic() < self.deadline:
            group = current_group(self.procs)
            if group:
                reached = min(p["batch"] for p in group)
                first = self.first_batch.setdefault(tuple(sorted(p["pid"] for p in group)), reached)
                if reached - first >= batches and self.reports.since(min(p["t"] for p in group)):
                    return group
            time.sleep(0.5)
        return None

    def _kill(self, group):
        target = self.rng.choice(group)
        os.kill(target["pid"], signal.SIGKILL)
        return {"pid": target["pid"], "rank": target["rank"], "world": target["world"]}

    def _hang(self, group):
        if len(group) < 2:  # one process: its own watchdog stops with it; nothing would notice
            return self._kill(group)
        target = self.rng.choice(group)
        os.kill(target["pid"], signal.SIGSTOP)
        self.stopped.append(target["pid"])
        return {"pid": target["pid"], "rank": target["rank"], "world": target["world"]}

    def _worker_node(self, group):
        """A removable (non-head) node that hosts a rank of ``group``; None: try again later."""
        hosting = {p["node"] for p in group}
        candidates = [n for n in self.nodes if n.node_id in hosting]
        return self.rng.choice(candidates) if candidates else None

    def _notice(self, group):
        node, event = self._take_node(group)
        if node is None:
            return event
        subprocess.run(
            ["ray", "drain-node", "--address", self.cluster.address, "--node-id", node.node_id,
             "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "chaos: spot preemption",
             "--deadline-remaining-seconds", str(NOTICE_DEADLINE_S)],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        noticed = time.time()
        # The cloud kills the node at the deadline; Ray moves the group off it first.
        while time.time() < noticed + NOTICE_DEADLINE_S and not self._group_left(node.node_id):
            time.sleep(0.5)
        self._remove_node(node)
        return event

    def _group_left(self, node_id: str) -> bool:
        group = current_group(self.procs)
        return bool(group) and all(p["node"] != node_id for p in group)

    def _remove(self, group):
        node, event = self._take_node(group)
        if node is not None:
            self._remove_node(node)
        return event

    def _take_node(self, group):
        """(a node to take away, the event) or (None, what to return: a skip, or None to try later)."""
        if not self.nodes:
            return None, {"skipped": "only the head is left"}
        node = self._worker_node(group)
        if node is None:
            return None, None
        ranks = sorted(p["rank"] for p in group if p["node"] == node.node_id)
        return node, {"node": node.node_id[:8], "ranks": ranks, "world": len(group)}

    def _remove_node(self, node) -> None:
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def _add(self, group):
        if len(self.nodes) + 1 >= MAX_NODES:
            return {"skipped": "every node is up"}
        self.nodes.append(self.cluster.add_node(num_cpus=1, resources={"slot": 1}))
        return {"nodes": len(self.nodes) + 1, "world": len(group)}

    def release(self) -> None:
        for pid in self.stopped:  # Ray ends them with their group; continue any it left behind
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


def main(argv: Optional[List[str]] = None) -> None:  # noqa: PLR0915 -- a script: set-up, run, report
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scratch")
    parser.add_argument("--plan", default="remove,hang,notice,add", help="kinds, comma-separated, or random:N")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", type=float, nargs=2, default=(1.0, 3.0), help="seconds between events")
    parser.add_argument("--budget-s", type=float, default=900.0, help="chaos stops after this long")
    parser.add_argument("--sleep-s", type=float, default=0.6, help="per batch while the chaos lasts")
    parser.add_argument(
        "--alone-sleep-s", type=float, default=1.5, help="per batch on one worker, while the chaos lasts"
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    if args.plan.startswith("random:"):
        plan = [rng.choice(KINDS) for _ in range(int(args.plan.split(":", 1)[1]))]
    else:
        plan = args.plan.split(",")
        unknown = sorted(set(plan) - set(KINDS))
        if unknown:
            parser.error(f"unknown chaos kinds {unknown}: choose from {KINDS}")

    import ray
    import ray.data
    from ray import cloudpickle
    from ray.cluster_utils import Cluster
    from ray.train import ScalingConfig

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.report.goodput import goodput, read_events, read_failures

    cloudpickle.register_pickle_by_value(h)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # The head: one train worker and two CPUs for Ray Data's reads (a restarted group's epoch starts
    # while the old group's executions let go of theirs); two worker nodes of one worker each.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3, "resources": {"slot": 1}, "include_dashboard": False},
    )
    nodes = [cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(MAX_NODES - 1)]
    ray.init(address=cluster.address, runtime_env={"worker_process_setup_hook": _fast_node_view})
    cluster.wait_for_nodes()
    data, records, procs = (os.path.join(args.scratch, d) for d in ("data", "records", "procs"))
    for folder in (records, procs):
        os.makedirs(folder, exist_ok=True)
    tokens = h.write_parquet(data)
    runs = os.path.join(args.scratch, "runs")
    outcome: Dict[str, Any] = {}
    done = threading.Event()
    reports = FirstReports()

    def train() -> None:
        try:
            outcome["result"] = RayTrainer(
                model=h.make_model,
                optimizers=h.make_sgd,
                datasets={"train": ray.data.read_parquet(data)},
                max_duration=f"{args.epochs}ep",
                global_batch_size=h.GLOBAL_BATCH,
                get_num_tokens_in_batch=h.count_tokens,
                scaling_config=ScalingConfig(
                    num_workers=(1, MAX_NODES),
                    resources_per_worker={"CPU": 1, "slot": 1},
                    elastic_resize_monitor_interval_s=2,
                ),
                storage_path=runs,
                run_name="chaos",
                checkpoint=CheckpointConfig(save_interval="3ba", keep=2, save_every_n_seconds=None),
                max_failures=len(plan) * 2 + 2,
                # Above an epoch's start on this cluster after restarts (21 s seen once at 20 s: a
                # "hang" in Ray Data's get, every rank waiting); the SIGSTOP is found 30 s after.
                hang_timeout=30.0,
                report_interval="3ba",
                driver_loggers=[reports],
                # Paced until the chaos is over; slower on one worker, so that Ray's resize check
                # and the grown group come before the chaos's pause runs out.
                callbacks=lambda: [h.RecordRows(records), Beacon(procs, args.sleep_s, args.alone_sleep_s)],
            ).fit()
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=train, daemon=True)
    started = time.time()
    thread.start()
    chaos = Chaos(
        cluster, nodes, args.scratch, os.path.join(runs, "chaos"), reports, plan, args.seed, args.pause, args.budget_s
    )
    try:
        chaos.run(done)
        chaos.finish()
        thread.join()
    finally:
        chaos.release()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    lineage = h.assert_every_row_once_per_epoch(records, args.epochs)
    hangs, preemptions = read_events(os.path.join(runs, "chaos"))
    failures = read_failures(os.path.join(runs, "chaos"))  # the controller's record of each failed group
    summary = goodput(result.history, hangs, preemptions, failures)
    print(
        f"Chaos soak: {len(chaos.events)} events in {time.time() - started:.0f} s, goodput "
        f"{summary['goodput']:.0%}, "
        + ", ".join(f"{r['cause']}: {r['lost_s']:.1f} s lost" for r in summary["restarts"]),
        flush=True,
    )
    print(
        "CHAOS_RESULT "
        + json.dumps(
            {
                "timestamp": h.timestamp_of(result),
                "expected": h.expected_timestamp(tokens, args.epochs),
                "events": chaos.events,
                "plan": plan,
                "hangs": hangs,
                "preemptions": preemptions,
                "failures": failures,
                "goodput": summary,
                "attempts": max(e["attempt"] for e in result.history),
                "worlds": [lineage[key][0] for key in sorted(lineage)],
            },
            default=str,
        ),
        flush=True,
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
