"""FSDP2 vs DDP on 2 gloo ranks (CPU): per-rank parameter + optimizer memory, step time, and the
training-thread time blocked by a sharded checkpoint save, async vs sync.

Model: ``--depth`` x Linear(``--width``, ``--width``) blocks (+ a 10-way head) in a
`ClassifierModel`; default 12 x 2048^2 = 50.4 M parameters = 201 MB fp32. AdamW (two state
tensors per parameter). Each rank runs the `Trainer` (``parallelism="ddp"`` and then
``FSDPConfig(shard_modules=["Block"])``) on its own random data, batch 8:

1. Memory: after the first optimizer step, the bytes of this rank's parameters and optimizer
   state (``to_local()`` of each DTensor under FSDP: only the shard this rank holds). Also the
   process's peak RSS (``ru_maxrss``), which includes gradients, DDP's buckets, FSDP's
   all-gather buffers and the Python/torch runtime.
2. Step time: median of ``--steps`` timed steps (after 2 warm-up steps) per arm, arms
   interleaved DDP, FSDP, DDP, FSDP... for ``--repeats`` rounds; the ratio of medians.
3. Blocked time per sharded save: ``Checkpointer.save()`` wall time on the training thread
   with ``async_save=True`` (staging copy to CPU memory; the DCP write and commit run in the
   background) and ``async_save=False`` (the whole write and commit), saving the FSDP state to a
   local temp dir; each save waits for the previous one first (outside the timed part).

Usage::

    python bench/fsdp.py                      # 2 ranks, ~201 MB model
    python bench/fsdp.py --width 1024 --depth 6 --repeats 2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _trainer(rank: int, args: argparse.Namespace, parallelism: Any, checkpoint: Any = None, steps: int = 1) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Trainer
    from raytrain_events.models import ClassifierModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[Block(args.width) for _ in range(args.depth)], torch.nn.Linear(args.width, 10))
    model = ClassifierModel(net, num_classes=10)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(8 * steps, args.width, generator=g), torch.randint(0, 10, (8 * steps,), generator=g)
    )
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4),
        parallelism=parallelism,
        checkpoint=checkpoint,
    )


def _local_bytes(trainer: Any) -> Dict[str, int]:
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in trainer.state.model.parameters())
    optim = sum(
        nbytes(v)
        for opt in trainer.state.optimizers
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return {"params": params, "optimizer": optim}


def _time_steps(rank: int, args: argparse.Namespace, parallelism: Any) -> List[float]:
    from raytrain_events import Callback

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: List[float] = []

        def batch_start(self, state, logger) -> None:
            self.t0 = time.perf_counter()

        def batch_end(self, state, logger) -> None:
            self.times.append(time.perf_counter() - self.t0)

    trainer = _trainer(rank, args, parallelism, steps=args.steps + 2)
    timer = Timer()
    trainer.state.callbacks.append(timer)
    trainer.engine.refresh()
    trainer.fit()
    return timer.times[2:]


def _blocked_save(rank: int, args: argparse.Namespace, async_save: bool, folder: str) -> List[float]:
    from raytrain_events.checkpoint import CheckpointConfig

    config = CheckpointConfig(
        save_folder=folder,
        async_save=async_save,
        save_final=False,
        save_on_sigterm=False,
        lock_run_dir=False,
        save_every_n_seconds=None,
    )
    trainer = _trainer(rank, args, {"shard_modules": ["Block"]}, checkpoint=config)
    trainer.fit()
    checkpointer = trainer._checkpointer
    checkpointer._writer = checkpointer._writer.__class__() if async_save else None  # fit() closed it
    out = []
    for _ in range(args.saves):
        checkpointer._last_saved_batch = None
        start = time.perf_counter()
        saved = checkpointer.save()
        out.append(time.perf_counter() - start)
        saved.wait()
    if checkpointer._writer is not None:
        checkpointer._writer.close()
    return out


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result: Dict[str, Any] = {}
    for name, parallelism in (("ddp", "ddp"), ("fsdp", {"shard_modules": ["Block"]})):
        trainer = _trainer(rank, args, parallelism)
        trainer.fit()
        result[f"{name}_bytes"] = _local_bytes(trainer)
        del trainer
    times: Dict[str, List[float]] = {"ddp": [], "fsdp": []}
    for repeat in range(args.repeats):
        order = ("ddp", "fsdp") if repeat % 2 == 0 else ("fsdp", "ddp")
        for name in order:
            times[name] += _time_steps(rank, args, "ddp" if name == "ddp" else {"shard_modules": ["Block"]})
    result["step_s"] = times
    blocked: Dict[str, List[float]] = {"async": [], "sync": []}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        for repeat in range(args.repeats):
            for mode in ("async", "sync") if repeat % 2 == 0 else ("sync", "async"):
                blocked[mode] += _blocked_save(rank, args, mode == "async", os.path.join(shared[0], f"{mode}{repeat}"))
        dist.barrier()
    result["blocked_s"] = blocked
    result["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _summary(values: List[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms (min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = args.depth * (args.width * args.width + args.width) + args.width * 10 + 10
    print(f"model: {params / 1e6:.1f} M parameters = {params * 4 / 2**20:.0f} MiB fp32; AdamW; 2 gloo ranks on CPU")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(2, port, args, out_dir), nprocs=2, start_method="spawn")
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    for rank, r in enumerate(ranks):
        ddp, fsdp = r["ddp_bytes"], r["fsdp_bytes"]
        ddp_total, fsdp_total = sum(ddp.values()), sum(fsdp.values())
        print(
            f"rank {rank}: params+optimizer DDP {ddp_total / 2**20:.0f} MiB "
            f"(params {ddp['params'] / 2**20:.0f}, optimizer {ddp['optimizer'] / 2**20:.0f}), "
            f"FSDP {fsdp_total / 2**20:.0f} MiB (params {fsdp['params'] / 2**20:.0f}, optimizer "
            f"{fsdp['optimizer'] / 2**20:.0f}): FSDP/DDP = {fsdp_total / ddp_total:.3f}; peak RSS {r['maxrss_mb']:.0f} MiB"
        )
    ddp_steps = [t for r in ranks for t in r["step_s"]["ddp"]]
    fsdp_steps = [t for r in ranks for t in r["step_s"]["fsdp"]]
    print(f"step time DDP  {_summary(ddp_steps)}")
    print(f"step time FSDP {_summary(fsdp_steps)}")
    print(f"step time ratio FSDP/DDP (medians): {statistics.median(fsdp_steps) / statistics.median(ddp_steps):.2f}")
    sync = [t for r in ranks for t in r["blocked_s"]["sync"]]
    asyn = [t for r in ranks for t in r["blocked_s"]["async"]]
    print(f"blocked per sharded save, sync:  {_summary(sync)}")
    print(f"blocked per sharded save, async: {_summary(asyn)}")
    print(f"async/sync blocked (medians): {statistics.median(asyn) / statistics.median(sync):.3f}")


if __name__ == "__main__":
    main()
