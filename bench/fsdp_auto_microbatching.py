"""The per-step price of ``grad_accum="auto"`` under FSDP on 2 gloo ranks (CPU), where no rank runs
out of memory: FSDP with a fixed ``grad_accum`` against the same run with ``"auto"``, whose ranks
run a one-integer all-reduce before each of FSDP's collectives (`parallel/oom_agreement.py`).

Model: ``--depth`` x Block(Linear(``--width``)) + a 10-way head, each Block an FSDP unit; SGD;
batch 8 per rank; ``--grad-accum`` microbatches in the fixed arm (``"auto"`` starts at 1, so the
fixed arm uses 1 too unless told). Step time: median of ``--steps`` timed steps per arm (after 2
warm-up steps), arms interleaved for ``--repeats`` rounds; the ratio of medians. Also the checks
per step and the median time of one such check on its own (an all-reduce of one int64 on the
host group), so the price per check is visible apart from the model.

Usage::

    python bench/fsdp_auto_microbatching.py                       # 8 x 1024^2, 2 ranks
    python bench/fsdp_auto_microbatching.py --width 256 --depth 4 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from fsdp import Block  # noqa: E402  # the same block as bench/fsdp.py (this script's folder is on sys.path)


def _run(rank: int, args: argparse.Namespace, grad_accum: Any) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Callback, Trainer
    from raytrain_events.dist import TorchDist
    from raytrain_events.models import ClassifierModel

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: List[float] = []

        def batch_start(self, state: Any, logger: Any) -> None:
            self.t0 = time.perf_counter()

        def batch_end(self, state: Any, logger: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)

    steps = args.steps + 2
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[Block(args.width) for _ in range(args.depth)], torch.nn.Linear(args.width, 10))
    model = ClassifierModel(net, num_classes=10)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(8 * steps, args.width, generator=g), torch.randint(0, 10, (8 * steps,), generator=g)
    )
    timer = Timer()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
        grad_accum=grad_accum,
        parallelism={"shard_modules": ["Block"]},
        callbacks=[timer],
        dist=TorchDist(torch.device("cpu")),
    )
    trainer.fit()
    auto = trainer._auto
    checks = auto.agreement.checks if auto is not None and auto.agreement is not None else 0
    return {"times": timer.times[2:], "checks_per_step": checks / steps}


def _check_time(n: int = 200) -> List[float]:
    from raytrain_events.dist import TorchDist

    dist = TorchDist(torch.device("cpu"))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.sum_ints_async([0]).wait()
        times.append(time.perf_counter() - t0)
    return times


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    times: Dict[str, List[float]] = {"fixed": [], "auto": []}
    checks = 0.0
    for repeat in range(args.repeats):
        for name in ("fixed", "auto") if repeat % 2 == 0 else ("auto", "fixed"):
            got = _run(rank, args, args.grad_accum if name == "fixed" else "auto")
            times[name] += got["times"]
            checks = max(checks, got["checks_per_step"])
    result = {"times": times, "checks_per_step": checks, "check_s": _check_time()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _summary(values: List[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f} ms (min {min(values) * 1e3:.2f}, max {max(values) * 1e3:.2f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = args.depth * (args.width * args.width + args.width) + args.width * 10 + 10
    print(f"model: {params / 1e6:.1f} M parameters, {args.depth + 1} FSDP units; 2 gloo ranks on CPU")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(2, port, args, out_dir), nprocs=2, start_method="spawn")
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    fixed = [t for r in ranks for t in r["times"]["fixed"]]
    auto = [t for r in ranks for t in r["times"]["auto"]]
    check = [t for r in ranks for t in r["check_s"]]
    print(f"step time FSDP grad_accum={args.grad_accum}: {_summary(fixed)}")
    print(f"step time FSDP grad_accum='auto': {_summary(auto)}")
    print(f"ratio auto/fixed (medians): {statistics.median(auto) / statistics.median(fixed):.3f}")
    print(f"checks per step: {ranks[0]['checks_per_step']:.1f}; one check alone: {_summary(check)}")


if __name__ == "__main__":
    main()
