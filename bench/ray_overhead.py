"""Ray overhead: `raytrain_events.RayTrainer` vs a hand-written Ray Train loop, same model/data/workers.

Both arms go through Ray Train V2's ``TorchTrainer`` on one local Ray instance (loopback only),
train the same MLP 64 -> H -> H -> 10 (seeded) with SGD (lr 0.01) and cross-entropy on the same
Ray Dataset (synthetic, seeded; columns ``x``, ``y``), with the same per-worker batch size (64)
and the same number of workers (gloo DDP on CPU; Ray gives each worker 1 CPU and 1 torch thread):

* **ours**: ``RayTrainer(model=ClassifierModel(mlp), optimizers=SGD, ...)`` with its default
  report interval: the full event loop, the per-batch global counts (riding on DDP's gradient
  all-reduce, `raytrain_events.trainer.counters`), the global-order train data (part 1; see
  ``bench/data_loader.py``) and `RayReporter`.
* **plain**: a ``train_loop_per_worker`` written by hand: ``ray.train.torch.prepare_model``
  (DDP), ``get_dataset_shard("train").iter_torch_batches(batch_size=64)``, SGD,
  ``F.cross_entropy``, one ``ray.train.report`` per epoch (the last one is the final report).

Part 1, end to end (what a user sees), measured inside the workers on rank 0 so Ray's own
start-up stays apart; ours and plain are separate ``fit()`` calls, interleaved (alternating which
goes first) and repeated; medians are reported:

* **start-up**: the train function's first line -> the start of the first batch (ours: the
  ``BATCH_START`` event; plain: the first batch out of the iterator). Ours' entry time is taken
  by a wrapper around ``raytrain_events.ray.worker.train_loop_per_worker``, which
  ``RayTrainer.fit`` imports at call time; the clock is read by a small `Callback` (one list
  append per ``BATCH_START``, a few reads per epoch); results travel as JSON files in a temp dir,
  written after training.
* **steady state**: global samples/s from the start of epoch 2 to the end of the last epoch
  (epoch boundaries, so per-epoch costs -- dataset iterator start, reports -- are in). Also the
  median gap between consecutive batch starts (the per-batch cost without stalls), the worker
  process's CPU time per batch (all its threads), and stalls (gaps > 5x the median).
* **fit() wall** on the driver, split on one clock (``perf_counter`` is CLOCK_MONOTONIC) into
  launch (controller, workers, process group, dataset split), start-up, train, finish (last epoch
  end -> train function returns: final report) and teardown.

Part 2, diagnostics, in ONE extra ``TorchTrainer`` run (``--workers`` workers, at least 2):

* the separate global-count collective ``TorchDist.sum_ints_async([samples, tokens, 0]).wait()``
  (the loop's fallback where the counters cannot ride on DDP's all-reduce: FSDP, auto microbatching):
  blocking (µs per call), and overlapped with one DDP forward/backward/SGD step of the same model
  on a 64-row batch the way the loop does it (launch, step, wait), against the step alone; blocks
  of 200 calls, modes interleaved, medians;
* an in-run A/B: the same workers alternate whole epochs of ours (a `Trainer` built by
  ``build_worker_trainer`` from the `RunSpec` RayTrainer would ship, ``max_duration="1ep"``,
  reporting only at FIT_END, after the timed epoch) and of plain (a fresh DDP model per epoch,
  reporting after the timed epoch). Neighbours' load hits both arms alike, so this pins the
  per-batch cost down far more tightly than separate runs on a shared machine; the reporting
  cadence is left to part 1. ``--ab-data`` picks the train data:

  - ``global`` (default since round 10): ours reads the train set as RayTrainer does
    (``TrainDataConfig``: the global order, `GlobalOrderLoader`), plain a streaming split of
    the same rows with ``iter_torch_batches`` (the hand-written loop of Ray's docs). This is
    **the whole Ray layer as users run it**, data path included. The global order serves each
    epoch once per worker group, so ours is one `Trainer` that trains on,
    ``fit(duration="1ep")`` per round.
  - ``shard`` (rounds 1-9 measured only this): both arms iterate the same Ray Data streaming
    split with ``iter_torch_batches``, and ours gets a fresh `Trainer` per epoch. Same data path
    on both sides, so this compares **the loops alone**. RayTrainer itself never reads train
    data this way.

Usage::

    python bench/ray_overhead.py                     # 2 workers, H=256, 16384 rows, 3 epochs, 3 repeats
    python bench/ray_overhead.py --hidden 1024 --repeats 5
    python bench/ray_overhead.py --repeats 0          # diagnostics only (collective + in-run A/B)
    python bench/ray_overhead.py --repeats 0 --collective-iters 0 --ab-control   # the A/B as A/A: its own spread
    python bench/ray_overhead.py --repeats 0 --collective-iters 0 --ab-rounds 30 --ab-data shard    # the loops alone
    python bench/ray_overhead.py --ours-report-interval 1ep --skip-diagnostics
    python bench/ray_overhead.py --repeats 1 --skip-diagnostics --profile /tmp/prof   # py-spy on rank 0

Exits 0 whatever the numbers; PASS/MISS lines compare with the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # only loopback works here
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import raytrain_events  # noqa: E402
import raytrain_events.ray.worker as rte_worker  # noqa: E402
from raytrain_events import Callback  # noqa: E402
from raytrain_events.models import ClassifierModel  # noqa: E402

D, C, B = 64, 10, 64
LR = 0.01
TARGET_THROUGHPUT_RATIO = 0.97
TARGET_STARTUP_DIFF_S = 1.0
STALL_FACTOR = 5.0


# ----------------------------------------------------------------------------- shared pieces
# What runs on a worker is defined in __main__, so cloudpickle ships it by value.


def make_net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, C))


def make_rows(n: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, D), dtype=np.float32)
    y = (x @ rng.standard_normal((D, C), dtype=np.float32)).argmax(-1).astype(np.int64)
    return [{"x": x[i], "y": int(y[i])} for i in range(n)]


def _write(out_dir: str, name: str, record: dict) -> None:
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _rank() -> int:
    import ray.train

    return ray.train.get_context().get_world_rank()


def _mark_exit(out_dir: str, tag: str) -> None:
    """Note when the train function returns (perf_counter is CLOCK_MONOTONIC: one clock for all processes)."""
    _write(out_dir, f"{tag}-rank{_rank()}-exit.json", {"t_exit": time.perf_counter()})


def _start_profiler(profile_dir, tag: str):
    """On rank 0, attach py-spy to this worker (all threads, idle included); None elsewhere or when off."""
    if not profile_dir or _rank() != 0:
        return None
    import shutil
    import signal
    import subprocess

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    proc = subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(os.getpid()),
            "--rate",
            "200",
            "--nonblocking",
            "--threads",
            "--idle",
            "--format",
            "raw",
            "-o",
            os.path.join(profile_dir, f"{tag}.txt"),
        ],
        stdout=open(os.path.join(profile_dir, f"{tag}.log"), "w"),
        stderr=subprocess.STDOUT,
        # Ray's worker threads block SIGINT and a child inherits the mask: unblock it so py-spy can be stopped.
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM}),
    )
    time.sleep(1.0)  # let it attach before the measured part starts
    return proc


def _stop_profiler(proc) -> None:
    if proc is not None:
        import signal

        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        proc.wait(timeout=60)


def _new_epoch(starts: list, sample: int) -> dict:
    return {"t0": time.perf_counter(), "c0": time.process_time(), "sp0": sample, "b0": len(starts)}


def _end_epoch(rec: dict, starts: list, sample: int) -> None:
    rec.update(t1=time.perf_counter(), c1=time.process_time(), sp1=sample, b1=len(starts))


# ------------------------------------------------------------------------------- arm: ours
class EpochClock(Callback):
    """Reads the clocks at each epoch boundary and appends perf_counter at each BATCH_START.

    At FIT_END it writes its record to ``<bench_out>/<bench_tag>-rank<r>.json``, or appends it
    to ``config["bench_sink"]`` when that list exists (the in-run A/B).
    """

    def __init__(self, config: dict) -> None:
        self.config = config
        self.starts: list = []
        self.epochs: list = []

    def batch_start(self, state, logger) -> None:
        self.starts.append(time.perf_counter())

    def epoch_start(self, state, logger) -> None:
        self.epochs.append(_new_epoch(self.starts, int(state.timestamp.sample)))

    def epoch_end(self, state, logger) -> None:
        _end_epoch(self.epochs[-1], self.starts, int(state.timestamp.sample))

    def fit_end(self, state, logger) -> None:
        record = {
            "rank": state.rank,
            "world": state.world_size,
            "t_entry": self.config.get("bench_t0"),
            "starts": self.starts,
            "epochs": self.epochs,
            "global_samples": True,
        }
        sink = self.config.get("bench_sink")
        if sink is not None:
            sink.append(record)
        else:
            _write(self.config["bench_out"], f"{self.config['bench_tag']}-rank{state.rank}.json", record)


class _Read:
    """A shipped run already read (``get`` as `Shipped.get`), so the entry's clock reaches the worker's spec."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def _timed_entry(inner, out_dir: str, tag: str, profile_dir=None):
    """Wrap RayTrainer's worker entry point: note when its first line runs and when it returns."""

    def entry(config):
        profiler = _start_profiler(profile_dir, tag)
        run = config["run"].get()  # the driver's shipped run (`raytrain_events.ray.shipped.Shipped`)
        run["spec"].config["bench_t0"] = time.perf_counter()
        try:
            return inner({**config, "run": _Read(run)})
        finally:
            _mark_exit(out_dir, tag)
            _stop_profiler(profiler)

    return entry


def ours_trainer(ds, args, *, max_duration: str, out_dir: str, tag: str, storage: str, report_interval=None):
    hidden = args.hidden
    kwargs = dict(
        model=lambda: ClassifierModel(make_net(hidden), num_classes=C),
        optimizers=lambda model: torch.optim.SGD(model.parameters(), lr=LR),
        datasets={"train": ds},
        max_duration=max_duration,
        batch_size=B,
        num_workers=args.workers,
        callbacks=lambda config: [EpochClock(config)],
        storage_path=storage,
        run_name=tag,
        config={"bench_out": out_dir, "bench_tag": tag},
    )
    report_interval = report_interval or args.ours_report_interval
    if report_interval:
        kwargs["report_interval"] = report_interval
    if args.ours_prefetch is not None:
        kwargs["prefetch_batches"] = args.ours_prefetch
    return raytrain_events.RayTrainer(**kwargs)


def run_ours(ds, args, out_dir: str, tag: str, storage: str):
    original = rte_worker.train_loop_per_worker
    rte_worker.train_loop_per_worker = _timed_entry(original, out_dir, tag, args.profile)  # fit() imports it per call
    try:
        t = time.perf_counter()
        ours_trainer(ds, args, max_duration=f"{args.epochs}ep", out_dir=out_dir, tag=tag, storage=storage).fit()
        return t, time.perf_counter()
    finally:
        rte_worker.train_loop_per_worker = original


# ------------------------------------------------------------------------------ arm: plain
def _plain_epoch(model, opt, shard, starts: list, seen: int, batch_size: int):
    """One pass over the shard; returns (seen, last loss)."""
    loss = None
    for batch in shard.iter_torch_batches(batch_size=batch_size):
        starts.append(time.perf_counter())
        x, y = batch["x"], batch["y"]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        seen += len(y)
    return seen, loss


def plain_loop(config: dict) -> None:
    profiler = _start_profiler(config.get("profile"), config["bench_tag"])
    try:
        _plain_loop(config)
    finally:
        _mark_exit(config["bench_out"], config["bench_tag"])
        _stop_profiler(profiler)


def _plain_loop(config: dict) -> None:
    t_entry = time.perf_counter()
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(make_net(config["hidden"]))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shard = ray.train.get_dataset_shard("train")
    ctx = ray.train.get_context()
    starts, epochs, seen = [], [], 0
    for epoch in range(config["epochs"]):
        rec = _new_epoch(starts, seen)
        seen, loss = _plain_epoch(model, opt, shard, starts, seen, config["batch_size"])
        _end_epoch(rec, starts, seen)
        epochs.append(rec)
        ray.train.report({"epoch": epoch + 1, "loss": float(loss)})
    _write(
        config["bench_out"],
        f"{config['bench_tag']}-rank{ctx.get_world_rank()}.json",
        {
            "rank": ctx.get_world_rank(),
            "world": ctx.get_world_size(),
            "t_entry": t_entry,
            "starts": starts,
            "epochs": epochs,
            "global_samples": False,
        },
    )


def run_plain(ds, args, out_dir: str, tag: str, storage: str):
    import ray.train
    from ray.train.torch import TorchTrainer

    t = time.perf_counter()
    TorchTrainer(
        plain_loop,
        train_loop_config={
            "hidden": args.hidden,
            "epochs": args.epochs,
            "batch_size": B,
            "bench_out": out_dir,
            "bench_tag": tag,
            "profile": args.profile,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        datasets={"train": ds},
        run_config=ray.train.RunConfig(name=tag, storage_path=storage),
    ).fit()
    return t, time.perf_counter()


# ------------------------------------------------------------------------------- summaries
def _steady(rec: dict, epochs: list) -> dict:
    """Throughput, median batch gap, CPU per batch and stalls over ``epochs`` of one rank's record."""
    seconds = epochs[-1]["t1"] - epochs[0]["t0"]
    samples = epochs[-1]["sp1"] - epochs[0]["sp0"]
    if not rec["global_samples"]:  # plain counts its own rows; every rank gets an equal share
        samples *= rec["world"]
    starts = rec["starts"]
    gaps = [starts[i + 1] - starts[i] for e in epochs for i in range(e["b0"], e["b1"] - 1)]
    batches = sum(e["b1"] - e["b0"] for e in epochs)
    gap = statistics.median(gaps)
    stalls = [g for g in gaps if g > STALL_FACTOR * gap]
    return {
        "steady_sps": samples / seconds,
        "batch_ms": gap * 1e3,
        "cpu_ms": (epochs[-1]["c1"] - epochs[0]["c0"]) / batches * 1e3,
        "stall_s": sum(stalls),
        "stalls": len(stalls),
    }


def _last(exits: list) -> float:
    """The last rank's exit time; nan when any rank's is unknown."""
    return float("nan") if any(t != t for t in exits) else max(exits)


def read_arm(out_dir: str, tag: str, workers: int, fit_span) -> dict:
    """Rank 0's start-up and steady state (epochs 2..N), and the phases of the driver's ``fit()``."""
    recs, exits = [], []
    for r in range(workers):
        with open(os.path.join(out_dir, f"{tag}-rank{r}.json")) as f:
            recs.append(json.load(f))
        exit_file = os.path.join(out_dir, f"{tag}-rank{r}-exit.json")
        if not os.path.exists(exit_file):  # seen on a second `ours` fit: the wrapper's `finally` left no file
            print(f"  ({tag}: rank {r} wrote no exit time; finish and teardown are unknown: nan)")
            exits.append(float("nan"))
            continue
        with open(exit_file) as f:
            exits.append(json.load(f)["t_exit"])
    r0 = recs[0]
    t_fit0, t_fit1 = fit_span
    out = _steady(r0, r0["epochs"][1:])
    out.update(
        startup=r0["starts"][0] - r0["t_entry"],
        startup_max=max(r["starts"][0] - r["t_entry"] for r in recs),
        epoch_s=[e["t1"] - e["t0"] for e in r0["epochs"]],
        fit_wall=t_fit1 - t_fit0,
        launch_s=min(r["t_entry"] for r in recs) - t_fit0,
        train_s=r0["epochs"][-1]["t1"] - r0["starts"][0],
        finish_s=_last(exits) - r0["epochs"][-1]["t1"],
        teardown_s=t_fit1 - _last(exits),
    )
    return out


# ------------------------------------------------------------ diagnostics (one extra run)
def diag_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    from raytrain_events.dist import TorchDist

    dist = TorchDist(torch.device("cpu"))
    out: dict = {}
    if config["collective_iters"]:
        out["collective"] = _collective(dist, config["hidden"], config["collective_iters"], block=200)
    if config["ab_rounds"]:
        out["ab"] = _ab(config, ray.train, ray.train.torch)
    if dist.rank == 0:
        _write(config["bench_out"], "diagnostics.json", out)


def _collective(dist, hidden: int, iters: int, block: int) -> dict:
    import ray.train.torch

    tdist = dist._tdist

    def timed(fn, n):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    def counter_blocking():
        dist.sum_ints_async([B, 0, 0]).wait()

    raw_tensor = torch.zeros(3, dtype=torch.int64)

    def raw_allreduce():  # the same all-reduce without the wrapper (reused tensor, no tolist)
        tdist.all_reduce(raw_tensor)

    model = ray.train.torch.prepare_model(make_net(hidden))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def step_overlapped():  # what the loop does: launch the count, train the batch, then wait
        pending = dist.sum_ints_async([B, 0, 0])
        step()
        pending.wait()

    def step_then_blocking():  # the count not overlapped, for comparison
        step()
        dist.sum_ints_async([B, 0, 0]).wait()

    modes = {
        "counter_blocking": counter_blocking,
        "raw_allreduce": raw_allreduce,
        "step": step,
        "step_overlapped": step_overlapped,
        "step_then_blocking": step_then_blocking,
    }
    for fn in modes.values():  # warm up
        timed(fn, 20)
    times: dict = {k: [] for k in modes}
    names = list(modes)
    for i in range(max(1, iters // block)):  # interleaved blocks, rotating the order
        for k in names[i % len(names) :] + names[: i % len(names)]:
            times[k].append(timed(modes[k], block))
    return times


def _ab(config: dict, train, train_torch) -> list:
    """Alternate whole epochs of ours and plain on the same workers and shard; rank 0's records."""
    spec = config["spec"]
    sink: list = []
    spec.config["bench_sink"] = sink
    shard = train.get_dataset_shard(config["plain_dataset"])

    built: list = []

    def ours_epoch():
        t_build = time.perf_counter()
        if config["ab_data"] == "shard":
            trainer = rte_worker.build_worker_trainer(spec)  # what train_loop_per_worker does
            trainer.fit()  # max_duration="1ep"; EpochClock appends its record to the sink
        elif not built:
            built.append(rte_worker.build_worker_trainer(spec))
            built[0].fit()
        else:  # the global order serves each epoch once per worker group: one Trainer trains on
            built[0].fit(duration="1ep")
        rec = sink.pop()
        rec["t_entry"] = t_build
        return rec, rec["epochs"][-1]

    def plain_epoch():
        t_build = time.perf_counter()
        model = train_torch.prepare_model(make_net(config["hidden"]))  # fresh DDP model, as ours gets
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        starts: list = []
        epoch = _new_epoch(starts, 0)
        seen, loss = _plain_epoch(model, opt, shard, starts, 0, B)
        _end_epoch(epoch, starts, seen)
        train.report({"loss": float(loss)})
        rec = {
            "world": train.get_context().get_world_size(),
            "starts": starts,
            "global_samples": False,
            "t_entry": t_build,
        }
        return rec, epoch

    if config.get("ab_control"):  # A/A: the "ours" slot runs plain too, to show the A/B's own spread
        ours_epoch = plain_epoch
    ours_epoch(), plain_epoch()  # warm-up round, not recorded
    rounds = []
    for i in range(config["ab_rounds"]):
        order = (
            (("ours", ours_epoch), ("plain", plain_epoch))
            if i % 2 == 0
            else (("plain", plain_epoch), ("ours", ours_epoch))
        )
        result = {}
        for arm, run_epoch in order:
            rec, epoch = run_epoch()
            result[arm] = _steady(rec, [epoch])
            result[arm]["startup_ms"] = (rec["starts"][epoch["b0"]] - rec["t_entry"]) * 1e3  # warm: -> 1st batch
        rounds.append(result)
    return rounds


def run_diagnostics(ds, args, out_dir: str, storage: str) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    # Ours reports only at FIT_END here, outside the timed epoch, as plain reports after its epoch:
    # the A/B compares the loops; the reporting cadence is part 1's business.
    spec = ours_trainer(
        ds, args, max_duration="1ep", out_dir=out_dir, tag="ab", storage=storage, report_interval="1000000ba"
    ).spec.for_workers()  # what RayTrainer ships to the workers (datasets by name only)
    data: dict = {"datasets": {"train": ds}}  # "shard": both arms iterate the same Ray Data streaming split
    if args.ab_data == "global":
        # Ours reads "train" as RayTrainer does (global order); plain a streaming split of the same rows.
        from raytrain_events.data.order import GlobalBatch
        from raytrain_events.data.ray.data_config import TrainDataConfig

        data = {"datasets": {"train": ds, "plain": ds}, "dataset_config": TrainDataConfig(batch=GlobalBatch(B))}
    TorchTrainer(
        diag_loop,
        train_loop_config={
            "hidden": args.hidden,
            "collective_iters": args.collective_iters,
            "ab_rounds": args.ab_rounds,
            "ab_control": args.ab_control,
            "ab_data": args.ab_data,
            "plain_dataset": "plain" if args.ab_data == "global" else "train",
            "bench_out": out_dir,
            "spec": spec,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=max(2, args.workers)),
        **data,
        run_config=ray.train.RunConfig(name="diagnostics", storage_path=storage),
    ).fit()
    with open(os.path.join(out_dir, "diagnostics.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16384, help="rows in the train set (all workers together)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end ours/plain pairs (0: diagnostics only)")
    parser.add_argument("--collective-iters", type=int, default=2000, help="calls per collective mode (0: skip)")
    parser.add_argument("--ab-rounds", type=int, default=6, help="ours/plain epoch pairs in the in-run A/B (0: skip)")
    parser.add_argument(
        "--ab-control", action="store_true", help="A/A control: both arms of the in-run A/B run plain (its own spread)"
    )
    parser.add_argument(
        "--ab-data",
        choices=("global", "shard"),
        default="global",
        help="in-run A/B train data: 'global' (default): ours reads the train set in RayTrainer's global order "
        "(TrainDataConfig, GlobalOrderLoader), plain a streaming split of the same rows: the Ray layer as users "
        "run it; 'shard': both arms iterate one Ray Data streaming split: the loops alone",
    )
    parser.add_argument(
        "--ours-prefetch",
        type=int,
        metavar="N",
        help="RayTrainer(prefetch_batches=N) for ours (default: RayTrainer's own default)",
    )
    parser.add_argument("--skip-diagnostics", action="store_true", help="no collective timing, no in-run A/B")
    parser.add_argument(
        "--ours-report-interval",
        metavar="TIME",
        help="RayTrainer(report_interval=...) for ours (default: RayTrainer's own default)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="attach py-spy to rank 0 of each end-to-end run; stacks to DIR"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (per-rank JSON records, Ray run dirs)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (steady state is epochs 2..N)")
    if args.profile:
        args.profile = os.path.abspath(args.profile)
        os.makedirs(args.profile, exist_ok=True)

    import ray
    import ray.data

    t_all = time.perf_counter()
    from raytrain_events.ray.embedded import own_state_api

    kwargs = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False}
    with own_state_api(kwargs):  # Train's cleaner asks this instance's state API, not another's
        ray.init(**kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items(make_rows(args.rows), override_num_blocks=4 * args.workers)
    work = tempfile.mkdtemp(prefix="ray_overhead_")
    storage = os.path.join(work, "runs")
    print(
        f"ray_overhead: workers={args.workers} hidden={args.hidden} rows={args.rows} epochs={args.epochs} "
        f"batch/worker={B} repeats={args.repeats} (torch {torch.__version__}, ray {ray.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})",
        flush=True,
    )

    diag = None
    if not args.skip_diagnostics and (args.collective_iters or args.ab_rounds):
        # First: it also warms the page cache for the worker processes' imports before part 1.
        print("  diagnostics run (collective timing, in-run A/B) ...", flush=True)
        diag = run_diagnostics(ds, args, work, storage)

    runners = {"ours": run_ours, "plain": run_plain}
    results: dict = {"ours": [], "plain": []}
    for i in range(args.repeats):
        order = ("ours", "plain") if i % 2 == 0 else ("plain", "ours")
        for arm in order:
            tag = f"{arm}-{i}"
            rec = read_arm(work, tag, args.workers, runners[arm](ds, args, work, tag, storage))
            results[arm].append(rec)
            print(
                f"  repeat {i} {arm:5s}: start-up {rec['startup']:5.2f} s | steady {rec['steady_sps']:6.0f} sp/s, "
                f"batch {rec['batch_ms']:5.2f} ms median, {rec['cpu_ms']:5.2f} ms CPU, {rec['stalls']} stalls "
                f"{rec['stall_s']:4.2f} s | epochs {' '.join(f'{v:.2f}' for v in rec['epoch_s'])} s | fit "
                f"{rec['fit_wall']:5.1f} s = {rec['launch_s']:.1f} launch + {rec['startup']:.1f} start-up + "
                f"{rec['train_s']:.1f} train + {rec['finish_s']:.1f} finish + {rec['teardown_s']:.1f} teardown",
                flush=True,
            )
    ray.shutdown()
    if args.keep:
        print(f"  records kept in {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if results["ours"]:
        report_end_to_end(args, results)
    if diag is not None:
        report_diagnostics(args, diag)
    print(f"\ntotal bench time {time.perf_counter() - t_all:.0f} s (load average now {os.getloadavg()[0]:.1f})")


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report_end_to_end(args, results: dict) -> None:
    keys = (
        "startup",
        "startup_max",
        "steady_sps",
        "batch_ms",
        "cpu_ms",
        "stall_s",
        "fit_wall",
        "launch_s",
        "train_s",
        "finish_s",
        "teardown_s",
    )
    med = {arm: {k: statistics.median(r[k] for r in recs) for k in keys} for arm, recs in results.items()}
    pairs = list(zip(results["ours"], results["plain"]))

    def per_pair(fn, fmt):
        return " ".join(fmt.format(fn(o, p)) for o, p in pairs)

    ratio = med["ours"]["steady_sps"] / med["plain"]["steady_sps"]
    diff = med["ours"]["startup"] - med["plain"]["startup"]
    interval = args.ours_report_interval or "RayTrainer default"
    print()
    print(
        f"Part 1, end to end: medians of {args.repeats} interleaved repeats; rank 0's clock; steady state = epochs "
        f"2..{args.epochs} ({args.workers} workers, H={args.hidden}, {args.rows} rows, batch {B}/worker; "
        f"ours reports: {interval}; plain: every epoch)"
    )
    print()
    print(
        "| arm   | start-up to 1st batch (s) | slowest rank (s) | steady samples/s | median batch (ms) "
        "| CPU per batch (ms) | stalls (s) | fit() wall (s) |"
    )
    print(
        "| ----- | ------------------------: | ---------------: | ---------------: | ----------------: "
        "| -----------------: | ---------: | -------------: |"
    )
    for arm in ("plain", "ours"):
        m = med[arm]
        print(
            f"| {arm:5s} | {m['startup']:25.2f} | {m['startup_max']:16.2f} | {m['steady_sps']:16.0f} | "
            f"{m['batch_ms']:17.2f} | {m['cpu_ms']:18.2f} | {m['stall_s']:10.2f} | {m['fit_wall']:14.1f} |"
        )
    print()
    print(
        "fit() phases (s, medians): launch = fit() called -> train fn entry; finish = last epoch end -> "
        "train fn returns; teardown = -> fit() returns"
    )
    print()
    print("| arm   | launch | start-up | train | finish | teardown |")
    print("| ----- | -----: | -------: | ----: | -----: | -------: |")
    for arm in ("plain", "ours"):
        m = med[arm]
        print(
            f"| {arm:5s} | {m['launch_s']:6.1f} | {m['startup']:8.1f} | {m['train_s']:5.1f} | {m['finish_s']:6.1f} "
            f"| {m['teardown_s']:8.1f} |"
        )
    print()
    print(
        f"steady-state throughput ours/plain = {ratio:.3f} (per pair "
        f"{per_pair(lambda o, p: o['steady_sps'] / p['steady_sps'], '{:.3f}')}); "
        f"target >= {TARGET_THROUGHPUT_RATIO}: {_verdict(ratio >= TARGET_THROUGHPUT_RATIO)}"
    )
    print(
        f"  median batch plain/ours = {med['plain']['batch_ms'] / med['ours']['batch_ms']:.3f} "
        f"(per pair {per_pair(lambda o, p: p['batch_ms'] / o['batch_ms'], '{:.3f}')}); "
        f"CPU per batch ours - plain = {med['ours']['cpu_ms'] - med['plain']['cpu_ms']:+.2f} ms "
        f"(per pair {per_pair(lambda o, p: o['cpu_ms'] - p['cpu_ms'], '{:+.2f}')})"
    )
    print(
        f"start-up ours - plain = {diff:+.2f} s (per pair {per_pair(lambda o, p: o['startup'] - p['startup'], '{:+.2f}')}); "
        f"target <= {TARGET_STARTUP_DIFF_S:.0f} s: {_verdict(diff <= TARGET_STARTUP_DIFF_S)}"
    )
    print(
        f"fit() wall ours - plain = {med['ours']['fit_wall'] - med['plain']['fit_wall']:+.1f} s "
        f"(per pair {per_pair(lambda o, p: o['fit_wall'] - p['fit_wall'], '{:+.1f}')})"
    )


def report_diagnostics(args, diag: dict) -> None:
    workers = max(2, args.workers)
    if "ab" in diag:
        rounds = diag["ab"]
        ratios = [r["ours"]["steady_sps"] / r["plain"]["steady_sps"] for r in rounds]
        batch = [r["plain"]["batch_ms"] / r["ours"]["batch_ms"] for r in rounds]
        cpu = [r["ours"]["cpu_ms"] - r["plain"]["cpu_ms"] for r in rounds]
        keys = ("steady_sps", "batch_ms", "cpu_ms", "stall_s", "startup_ms")
        med = {arm: {k: statistics.median(r[arm][k] for r in rounds) for k in keys} for arm in ("plain", "ours")}
        startup = [r["ours"]["startup_ms"] - r["plain"]["startup_ms"] for r in rounds]
        ratio = statistics.median(ratios)
        print()
        print(
            f"Part 2a, in-run A/B, train data '{args.ab_data}' "
            f"({'ours: global order, plain: iter_torch_batches' if args.ab_data == 'global' else 'both: iter_torch_batches'})"
            f"{' -- A/A CONTROL: the ours arm runs plain' if args.ab_control else ''}: "
            f"{len(rounds)} rounds of one ours epoch + one plain epoch on the same "
            f"{workers} workers (order alternating; reports outside the timed epochs), rank 0, medians"
        )
        print()
        print(
            "| arm   | warm start-up: build -> 1st batch (ms) | epoch samples/s | median batch (ms) | CPU per batch (ms) | stalls (s) |"
        )
        print(
            "| ----- | -------------------------------------: | --------------: | ----------------: | -----------------: | ---------: |"
        )
        for arm in ("plain", "ours"):
            m = med[arm]
            print(
                f"| {arm:5s} | {m['startup_ms']:38.0f} | {m['steady_sps']:15.0f} | {m['batch_ms']:17.2f} | "
                f"{m['cpu_ms']:18.2f} | {m['stall_s']:10.2f} |"
            )
        print()
        print(
            f"epoch throughput ours/plain, median of per-round ratios = {ratio:.3f} "
            f"(rounds {' '.join(f'{r:.3f}' for r in ratios)}); "
            + (
                "A/A control: both arms plain, no verdict"
                if args.ab_control
                else f"target >= {TARGET_THROUGHPUT_RATIO}: {_verdict(ratio >= TARGET_THROUGHPUT_RATIO)}"
            )
        )
        print(
            f"  median batch plain/ours = {statistics.median(batch):.3f} (rounds {' '.join(f'{r:.3f}' for r in batch)}); "
            f"CPU per batch ours - plain = {statistics.median(cpu):+.2f} ms (rounds {' '.join(f'{c:+.2f}' for c in cpu)})"
        )
        print(
            f"  warm start-up ours - plain = {statistics.median(startup):+.0f} ms "
            f"(rounds {' '.join(f'{d:+.0f}' for d in startup)}; model, optimizer, DDP, loop set-up, first batch)"
        )
    if "collective" in diag:
        us = {k: statistics.median(v) * 1e6 for k, v in diag["collective"].items()}
        extra = us["step_overlapped"] - us["step"]
        print()
        print(
            f"Part 2b, the global-count collective ({workers} workers, gloo on loopback; median of 200-call blocks, "
            f"{args.collective_iters} calls per mode, modes interleaved)"
        )
        print()
        print("| what                                                  | µs per call |")
        print("| ----------------------------------------------------- | ----------: |")
        rows = [
            ("TorchDist.sum_ints_async([s, t, 0]).wait(), blocking", "counter_blocking"),
            ("torch.distributed.all_reduce(int64[3]), blocking", "raw_allreduce"),
            (f"DDP step alone (H={args.hidden}, batch {B}, fwd+bwd+SGD)", "step"),
            ("launch sum + step + wait (what the loop does)", "step_overlapped"),
            ("step, then blocking sum (no overlap)", "step_then_blocking"),
        ]
        for label, key in rows:
            print(f"| {label:53s} | {us[key]:11.1f} |")
        print()
        print(
            f"collective per batch: {us['counter_blocking']:.1f} µs blocking; overlapped with the step it adds "
            f"{extra:+.1f} µs ({extra / us['step'] * 100:+.1f}% of the step); not overlapped "
            f"{us['step_then_blocking'] - us['step']:+.1f} µs"
        )


if __name__ == "__main__":
    main()
