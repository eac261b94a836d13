"""GPU overhead: `raytrain_events.Trainer` vs a plain PyTorch loop on one CUDA GPU, and host syncs per batch.

On a GPU the loop's cost is not only its Python: every host sync (``.item()``, an event wait, a
blocking copy) stops the host from queueing the next kernels while the GPU works, which is what
makes small, launch-bound steps slow. This script measures both, the same MLP as the CPU benches
(64 -> H -> H -> 10, SGD, cross-entropy), batches already on the GPU so neither arm copies data:

* **one process** (part 1): plain loop vs ``Trainer(device="cuda")``, interleaved repeats of
  3-epoch fits, the step time taken after ``torch.cuda.synchronize()``; and, for each arm, the
  host syncs per batch counted with ``torch.cuda.set_sync_debug_mode("warn")``.
* **DDP ranks sharing the GPU** (part 2, ``--ranks N`` >= 2): ``plain`` (DDP) and ``ours`` alternate
  whole epochs in the same processes, as ``ddp_overhead.py`` does. On a GPU ours sums the batch
  counters with its host-side gloo collective, started before the batch, which never touches the
  GPU stream (`raytrain_events.trainer.counters` says why they do not ride on the gradients there).
  The backend is NCCL where its build lets ranks share one device, else gloo (``--backend``).

Usage::

    python bench/gpu_overhead.py                      # H=256 and 4096, 2 ranks
    python bench/gpu_overhead.py --hidden 256 --ranks 0 --repeats 9
    python bench/gpu_overhead.py --backend gloo --rounds 20

Needs CUDA (exits 0 with a message without it); see bench/README.md, "GPU overhead".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

from ddp_overhead import C, D, _quartiles, make_net, ours_trainer  # noqa: E402  (the same MLP and arms)

BATCH, BATCHES = 256, 64
RANK_ARMS = ("plain", "ours")


def gpu_batches(device: torch.device, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, D, generator=g).to(device), torch.randint(0, C, (BATCH,), generator=g).to(device))
        for _ in range(BATCHES)
    ]


def count_syncs(fn) -> int:
    """Host syncs while ``fn`` runs, as torch's sync debug mode reports them (one warning each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------ part 1
class OneProcess:
    """The two arms of part 1, each built once; ``run(arm, epochs)`` trains and returns seconds per step."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        self.data = gpu_batches(device)
        self.plain_model = make_net(hidden).to(device)
        self.plain_opt = torch.optim.SGD(self.plain_model.parameters(), lr=0.01)
        self.trainer = ours_trainer(hidden, self.data, device=device)
        self.trainer.fit()  # warm-up; later fits train on
        self.plain(1)

    def plain(self, epochs: int) -> None:
        model, opt = self.plain_model, self.plain_opt
        for _ in range(epochs):
            for x, y in self.data:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

    def ours(self, epochs: int) -> None:
        self.trainer.fit(duration=f"{epochs}ep")

    def step_time(self, arm: str, epochs: int = 3) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        getattr(self, arm)(epochs)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (epochs * BATCHES)


def one_process(hidden: int, repeats: int) -> None:
    arms = OneProcess(hidden, torch.device("cuda"))
    times: dict = {"plain": [], "ours": []}
    for i in range(repeats):
        for arm in ("plain", "ours") if i % 2 == 0 else ("ours", "plain"):
            times[arm].append(arms.step_time(arm))
    ratios = [o / p for p, o in zip(times["plain"], times["ours"])]
    syncs = {arm: count_syncs(lambda a=arm: getattr(arms, a)(1)) / BATCHES for arm in ("plain", "ours")}
    plain, ours = statistics.median(times["plain"]), statistics.median(times["ours"])
    print(
        f"  H={hidden:5d}: plain {plain * 1e6:7.1f} µs/step, ours {ours * 1e6:7.1f} µs/step, ours/plain time "
        f"{_quartiles(ratios)}; host syncs per batch: plain {syncs['plain']:.2f}, ours {syncs['ours']:.2f}",
        flush=True,
    )
    arms.trainer.close()


# ------------------------------------------------------------------------------------ part 2
class RankArms:
    """The arms of one rank sharing the GPU, each built once."""

    def __init__(self, hidden: int, rank: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from raytrain_events.dist import TorchDist

        self.data = gpu_batches(device, seed=rank)
        self.plain_model = DDP(make_net(hidden).to(device), device_ids=[device.index])
        self.plain_opt = torch.optim.SGD(self.plain_model.parameters(), lr=0.01)
        self.trainer = ours_trainer(hidden, self.data, dist=TorchDist(device))
        self.on_gradients = self.trainer._counters.on_gradients
        self._fitted = False

    def plain(self) -> None:
        for x, y in self.data:
            self.plain_opt.zero_grad()
            F.cross_entropy(self.plain_model(x), y).backward()
            self.plain_opt.step()

    def ours(self) -> None:
        self.trainer.fit(duration="1ep") if self._fitted else self.trainer.fit()
        self._fitted = True


def _timed(run_epoch) -> float:
    tdist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_epoch()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _rank_main(rank: int, ranks: int, port: int, out: str, hidden: int, rounds: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    tdist.init_process_group(backend, rank=rank, world_size=ranks, device_id=device if backend == "nccl" else None)
    try:
        arms = RankArms(hidden, rank, device)
        for name in RANK_ARMS:  # warm-up epoch
            _timed(getattr(arms, name))
        records = []
        for i in range(rounds):
            for name in RANK_ARMS if i % 2 == 0 else RANK_ARMS[::-1]:
                records.append({"round": i, "arm": name, "wall": _timed(getattr(arms, name))})
        syncs = {name: count_syncs(getattr(arms, name)) / BATCHES for name in RANK_ARMS}
        arms.trainer.close()
        if rank == 0:
            with open(os.path.join(out, "records.json"), "w") as f:
                json.dump({"records": records, "syncs": syncs, "on_gradients": arms.on_gradients}, f)
    finally:
        tdist.destroy_process_group()


def shared_gpu(hidden: int, ranks: int, rounds: int, backend: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="gpu_overhead_")
    try:
        mp.spawn(_rank_main, args=(ranks, port, out, hidden, rounds, backend), nprocs=ranks)
        with open(os.path.join(out, "records.json")) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    by_round: dict = {}
    for r in result["records"]:
        by_round.setdefault(r["round"], {})[r["arm"]] = r["wall"]
    walls = {arm: statistics.median(r[arm] for r in by_round.values()) / BATCHES * 1e6 for arm in RANK_ARMS}
    print(
        f"  H={hidden:5d}, {ranks} ranks, {backend}: per step plain {walls['plain']:.1f} µs, ours {walls['ours']:.1f} µs "
        f"(counters on the gradients: {result['on_gradients']})",
        flush=True,
    )
    for arm in RANK_ARMS[1:]:
        ratios = [r["plain"] / r[arm] for r in by_round.values()]
        print(f"    {arm}/plain throughput per round: {_quartiles(ratios)}")
    print("    host syncs per batch: " + ", ".join(f"{arm} {n:.2f}" for arm, n in result["syncs"].items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="256,4096", help="comma-separated hidden sizes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="part 1: interleaved 3-epoch fits per arm")
    parser.add_argument("--ranks", type=int, default=2, help="part 2: ranks sharing the GPU (0: skip part 2)")
    parser.add_argument("--rounds", type=int, default=15, help="part 2: epochs of each arm")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device here; nothing to measure.")
        return
    hiddens = [int(h) for h in args.hidden.split(",")]
    print(
        f"gpu_overhead: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}, "
        f"batch {BATCH}, {BATCHES} batches/epoch, {os.cpu_count()} CPUs",
        flush=True,
    )
    print("Part 1, one process (3-epoch fits, medians):", flush=True)
    for hidden in hiddens:
        one_process(hidden, args.repeats)
    if args.ranks < 2:
        return
    print(f"Part 2, {args.ranks} DDP ranks sharing the GPU ({args.rounds} rounds of alternating epochs):", flush=True)
    backends = ["nccl", "gloo"] if args.backend == "auto" else [args.backend]
    for hidden in hiddens:
        for backend in backends:
            try:
                shared_gpu(hidden, args.ranks, args.rounds, backend)
                backends = [backend]  # the first that works serves the other sizes
                break
            except Exception as exc:  # NCCL refuses ranks that share a device on some builds
                print(f"  {backend} failed: {str(exc).strip().splitlines()[-1][:300]}", flush=True)


if __name__ == "__main__":
    main()
