"""DDP overhead without Ray: `raytrain_events.Trainer` vs a plain DDP loop on the same gloo ranks.

`ray_overhead.py` measures ours against a hand-written Ray Train loop, where Ray Data, Ray's own
threads and a 15-45 s start-up come with every run. This script takes Ray out: it spawns
``--ranks`` processes (gloo on 127.0.0.1, one torch thread each), gives each the same seeded MLP
64 -> H -> H -> 10, SGD (lr 0.01), cross-entropy and its own 128 in-memory batches of 64 rows
(dicts with ``x`` and ``y``, as Ray Data yields), and alternates whole epochs of its arms in
the same processes, rotating the order every round:

* **plain**: ``DistributedDataParallel(mlp)``; zero_grad, forward, ``F.cross_entropy``, backward, step.
* **carry**: plain, plus what the loop adds so that the batch counters ride on DDP's gradient
  all-reduce (`raytrain_events.trainer.counters`): DDP wraps a `CountedModule`, backward runs on
  ``loss + counters.dot(pieces)`` and the averaged pieces are read back after backward.
* **ours**: ``Trainer(model=ClassifierModel(mlp), dist=TorchDist(), ...)``, built once and trained
  one more epoch per round (``fit(duration="1ep")``): the whole loop, events, global Timestamp and
  the counters on the gradients.
* **plain2** (only with ``--arms``): plain again, with a model of its own: an A/A control that
  shows how far two identical arms read apart in this set-up.

Per epoch it reads the wall clock and the main thread's CPU time (``time.thread_time``: what the
rank's Python and torch kernels cost, without gloo's own threads and without time spent waiting
for the other rank). Ratios are per round (adjacent epochs), so the VM's slow and fast phases hit
every arm alike.

``--perf`` also samples rank 0's main thread with ``perf record`` on CLOCK_MONOTONIC (the clock
``time.perf_counter`` reads) and assigns each sample to the arm whose epoch was running: the
extra CPU per batch of carry and ours over plain, split by shared object (the interpreter,
libtorch...) and by symbol, from one run.

Usage::

    python bench/ddp_overhead.py                 # H=256, 2 ranks, 30 rounds (~1 min)
    python bench/ddp_overhead.py --hidden 1024 --rounds 20
    python bench/ddp_overhead.py --perf          # + where the extra CPU goes (needs perf)
    python bench/ddp_overhead.py --arms plain,plain2,carry --rounds 60   # with the A/A control

Exits 0 whatever the numbers; see bench/README.md, "DDP overhead".
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

D, C, B, BATCHES = 64, 10, 64, 128
ARMS = ("plain", "carry", "ours", "plain2")
PERF_HZ = 4000


def make_net(hidden: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, C))


def ours_trainer(hidden: int, data: list, **kwargs):
    """Ours: a `Trainer` on the MLP (through `ClassifierModel`), SGD lr 0.01, one epoch per ``fit``."""
    from raytrain_events import Trainer
    from raytrain_events.models import ClassifierModel

    net = make_net(hidden)
    return Trainer(
        model=ClassifierModel(net, num_classes=C),
        train_dataloader=data,
        max_duration="1ep",
        optimizers=torch.optim.SGD(net.parameters(), lr=0.01),
        **kwargs,
    )


def _timed(run_epoch) -> tuple:
    """``(start, end, thread CPU)`` of one epoch, started together on every rank (the barrier is left out)."""
    tdist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    run_epoch()
    return start, time.perf_counter(), time.thread_time() - cpu


class Arms:
    """The arms of one rank, each built once (as a training job builds its model once)."""

    def __init__(self, hidden: int, rank: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from raytrain_events.dist import TorchDist
        from raytrain_events.trainer.counters import CountedModule, encode_counters, piece_bits

        g = torch.Generator().manual_seed(rank)
        self.data = [
            {"x": torch.randn(B, D, generator=g), "y": torch.randint(0, C, (B,), generator=g)} for _ in range(BATCHES)
        ]
        self.plain_model = DDP(make_net(hidden))
        self.plain_opt = torch.optim.SGD(self.plain_model.parameters(), lr=0.01)
        self.plain2_model = DDP(make_net(hidden))  # the A/A control: plain again, its own model
        self.plain2_opt = torch.optim.SGD(self.plain2_model.parameters(), lr=0.01)

        counted = CountedModule(make_net(hidden), tdist.get_world_size())
        self.carry_model, self.slot = DDP(counted), counted.counters
        self.carry_opt = torch.optim.SGD(counted.model.parameters(), lr=0.01)
        pieces = encode_counters([B, 0, 0], piece_bits(tdist.get_world_size()))
        self.pieces = torch.zeros_like(self.slot, requires_grad=False)
        self.pieces[: pieces.size] = torch.from_numpy(pieces).float()

        # CPU DDP even where a GPU is (TorchDist() would pick it).
        self.trainer = ours_trainer(hidden, self.data, dist=TorchDist(torch.device("cpu")))
        self._fitted = False

    def plain(self) -> None:
        self._plain(self.plain_model, self.plain_opt)

    def plain2(self) -> None:
        self._plain(self.plain2_model, self.plain2_opt)

    def _plain(self, model, opt) -> None:
        for batch in self.data:
            opt.zero_grad()
            F.cross_entropy(model(batch["x"]), batch["y"]).backward()
            opt.step()

    def carry(self) -> None:
        model, opt, slot, pieces = self.carry_model, self.carry_opt, self.slot, self.pieces
        for batch in self.data:
            opt.zero_grad()
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            (loss + slot.dot(pieces)).backward()
            summed, slot.grad = slot.grad, None
            opt.step()
            summed.numpy().tobytes()  # the loop compares the averaged pieces with the last batch's

    def ours(self) -> None:
        if self._fitted:
            self.trainer.fit(duration="1ep")
        else:
            self.trainer.fit()
            self._fitted = True


def _rank_main(
    rank: int, ranks: int, port: int, out: str, hidden: int, rounds: int, perf: bool, arms_run: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        arms = Arms(hidden, rank)
        for name in arms_run:  # warm-up epoch, not recorded
            _timed(getattr(arms, name))
        sampler = None
        if perf and rank == 0:
            cmd = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(PERF_HZ)]
            cmd += ["-t", str(threading.get_native_id()), "-o", os.path.join(out, "perf.data")]
            sampler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # perf attaches
        records = []
        for i in range(rounds):
            for name in arms_run[i % len(arms_run) :] + arms_run[: i % len(arms_run)]:
                start, end, cpu = _timed(getattr(arms, name))
                records.append({"round": i, "arm": name, "start": start, "end": end, "wall": end - start, "cpu": cpu})
        if sampler is not None:
            sampler.send_signal(2)  # SIGINT: perf writes its file
            sampler.wait(timeout=60)
        arms.trainer.close()
        if rank == 0:
            with open(os.path.join(out, "records.json"), "w") as f:
                json.dump(records, f)
    finally:
        tdist.destroy_process_group()


# ------------------------------------------------------------------------------------ report
def _per_round(records: list) -> dict:
    rounds: dict = collections.defaultdict(dict)
    for r in records:
        rounds[r["round"]][r["arm"]] = r
    return rounds


def _quartiles(values: list) -> str:
    q = statistics.quantiles(values, n=4)
    return f"median {statistics.median(values):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"


def _arms_in(records: list) -> list:
    return [name for name in ARMS if any(r["arm"] == name for r in records)]


def report_timing(records: list) -> None:
    rounds, arms = _per_round(records), _arms_in(records)
    print()
    print("| arm    | wall per batch (µs) | main-thread CPU per batch (µs) |")
    print("| ------ | ------------------: | -----------------------------: |")
    for name in arms:
        wall = statistics.median(r[name]["wall"] for r in rounds.values()) / BATCHES * 1e6
        cpu = statistics.median(r[name]["cpu"] for r in rounds.values()) / BATCHES * 1e6
        print(f"| {name:6s} | {wall:19.1f} | {cpu:30.1f} |")
    print()
    for name in arms[1:]:
        ratios = [r["plain"]["wall"] / r[name]["wall"] for r in rounds.values()]
        extra = [(r[name]["cpu"] - r["plain"]["cpu"]) / BATCHES * 1e6 for r in rounds.values()]
        total = sum(r["plain"]["wall"] for r in rounds.values()) / sum(r[name]["wall"] for r in rounds.values())
        print(
            f"{name}/plain throughput: per-round {_quartiles(ratios)}, all rounds together {total:.3f}; "
            f"extra main-thread CPU per batch {statistics.median(extra):+.1f} µs"
        )


def _perf_samples(perf_data: str):
    """(time, symbol, shared object) of each sample."""
    text = subprocess.run(
        ["perf", "script", "-i", perf_data, "-F", "time,ip,sym,dso"], capture_output=True, text=True, check=True
    ).stdout
    for line in text.splitlines():
        stamp, _, rest = line.strip().partition(":")
        parts = rest.split(None, 1)
        if len(parts) < 2:
            continue
        symbol, _, dso = parts[1].rpartition(" (")
        yield float(stamp), symbol[:90], os.path.basename(dso.rstrip(")"))


def report_perf(records: list, perf_data: str, top: int = 12) -> None:
    arms = _arms_in(records)
    spans = sorted((r["start"], r["end"], r["arm"]) for r in records)
    starts = [s[0] for s in spans]
    by_dso = {name: collections.Counter() for name in arms}
    by_symbol = {name: collections.Counter() for name in arms}
    for stamp, symbol, dso in _perf_samples(perf_data):
        i = bisect.bisect_right(starts, stamp) - 1
        if i >= 0 and stamp <= spans[i][1]:
            by_dso[spans[i][2]][dso] += 1
            by_symbol[spans[i][2]][symbol] += 1
    batches = collections.Counter()
    for r in records:
        batches[r["arm"]] += BATCHES
    us = {name: 1e6 / PERF_HZ / batches[name] for name in arms}  # µs per batch of one sample

    def extra(table, name, key):
        return table[name][key] * us[name] - table["plain"][key] * us["plain"]

    print()
    print(f"perf, rank 0's main thread ({PERF_HZ} Hz, samples assigned to the arm whose epoch ran):")
    for name in arms:
        print(f"  {name:6s}: {sum(by_dso[name].values()) * us[name]:7.1f} µs CPU per batch")
    for name in arms[1:]:
        print(f"\n{name} - plain, µs per batch, by shared object:")
        keys = sorted(set(by_dso[name]) | set(by_dso["plain"]), key=lambda k: -abs(extra(by_dso, name, k)))
        for key in keys[:6]:
            print(f"  {extra(by_dso, name, key):+7.1f}  {key}")
        print(f"{name} - plain, µs per batch, largest by symbol:")
        keys = sorted(set(by_symbol[name]) | set(by_symbol["plain"]), key=lambda k: -extra(by_symbol, name, k))
        for key in keys[:top]:
            print(f"  {extra(by_symbol, name, key):+7.1f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30, help="epochs of each arm (after one warm-up epoch each)")
    parser.add_argument(
        "--arms",
        default=",".join(ARMS[:3]),
        help=f"comma-separated, plain first, of {','.join(ARMS)} (default: %(default)s)",
    )
    parser.add_argument("--perf", action="store_true", help="sample rank 0 with perf; split the extra CPU by arm")
    args = parser.parse_args()
    arms_run = tuple(args.arms.split(","))
    if arms_run[0] != "plain" or not set(arms_run) <= set(ARMS):
        parser.error(f"--arms: plain first, then any of {', '.join(ARMS[1:])}")
    if args.ranks < 2:
        parser.error("--ranks must be >= 2 (DDP)")
    if args.perf and shutil.which("perf") is None:
        parser.error("--perf needs the perf tool (linux-perf) on PATH")
    print(
        f"ddp_overhead: ranks={args.ranks} hidden={args.hidden} batches/epoch={BATCHES} batch={B} rounds={args.rounds} "
        f"(torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="ddp_overhead_")
    try:
        mp.spawn(
            _rank_main, args=(args.ranks, port, out, args.hidden, args.rounds, args.perf, arms_run), nprocs=args.ranks
        )
        with open(os.path.join(out, "records.json")) as f:
            records = json.load(f)
        report_timing(records)
        if args.perf:
            report_perf(records, os.path.join(out, "perf.data"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nload average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
