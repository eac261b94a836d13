"""Restart from object storage vs the node-local tier: time to first batch of a whole-run restart.

One checkpoint of a model with ``--mb`` MiB of parameters (plain SGD: no optimizer state, so
``state.pt`` is about ``--mb`` MiB) is saved once to a local S3 server (moto, in a child process: the
same server as ``bench/checkpoint_io.py``) with ``CheckpointConfig(local_dir=...)``, so this node also
holds a copy. Then, interleaved, ``--repeats`` restarts of each arm, in this process:

* ``storage``: ``Trainer(..., checkpoint=CheckpointConfig(save_folder=s3://..., autoresume=True))``:
  every byte of the state is read from S3 (concurrent ranged GETs, CRC32 checked as they arrive);
* ``local tier``: the same with ``local_dir=`` the directory the save filled: the manifest comes from S3
  (one GET), ``state.pt`` from local disk (CRC32 over an mmap against the committed manifest, then
  ``torch.load(mmap=True)``).

Each restart is timed from ``Trainer(...)`` (model built, checkpoint found, read and applied) to the end
of its first batch (``restart``), ``Trainer(...)`` alone (``construct``: the model built and the checkpoint
loaded), and the checkpoint load alone (``load``: `Checkpointer.load`, found, read, verified, applied). S3
bytes read are counted per restart, in all and of payload files (``state.pt``, RNG files: the local tier's
must be 0; below ~32 MiB a checkpoint is packed into its ``manifest.json``, so use ``--mb`` 64 or more). Medians with the
min-max range; the ratio is storage / local tier (how many times faster the local tier restarts).

The local copy was just written, so it is in the page cache: a restart of the processes on a node that
stayed up (the common case: a worker or the head died, the node did not). A rebooted node or a cold
cache reads the local disk (NVMe: several GB/s); storage here is moto on loopback, far faster than a
real bucket across a network, so the ratio against real object storage is larger still.

Usage::

    python bench/local_tier.py                    # --mb 256 --repeats 5
    python bench/local_tier.py --mb 64 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from bench.checkpoint_io import s3_server  # noqa: E402
from raytrain_events import Callback, Trainer  # noqa: E402
from raytrain_events.checkpoint import CheckpointConfig  # noqa: E402
from tests.parallel.io_count import count_s3_reads, payload_bytes  # noqa: E402


def _model(mb: int) -> torch.nn.Module:
    from raytrain_events.models import ClassifierModel

    h = int((mb * 2**20 / 4 / 2) ** 0.5)  # two h x h layers of float32
    net = torch.nn.Sequential(
        torch.nn.Linear(16, h), torch.nn.Linear(h, h), torch.nn.Linear(h, h), torch.nn.Linear(h, 2)
    )
    return ClassifierModel(net, num_classes=2)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


class _FirstBatch(Callback):
    def __init__(self) -> None:
        self.at: float = 0.0

    def batch_end(self, state: Any, logger: Any) -> None:
        if not self.at:
            self.at = time.perf_counter()


def _trainer(mb: int, folder: str, options: Dict[str, Any], duration: str, **ckpt: Any) -> Trainer:
    model = _model(mb)
    return Trainer(
        model=model,
        train_dataloader=_loader(),
        max_duration=duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        checkpoint=CheckpointConfig(
            save_folder=folder,
            storage_options=options,
            save_every_n_seconds=None,
            save_on_sigterm=False,
            lock_run_dir=False,
            **ckpt,
        ),
        callbacks=[_FirstBatch()],
        seed=1,
    )


_LOAD: List[float] = []  # seconds of each Checkpointer.load (the checkpoint found, read and applied)


def _timed_load(real: Any) -> Any:
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            _LOAD.append(time.perf_counter() - t)

    return load


def _restart(mb: int, folder: str, options: Dict[str, Any], local_dir: Any) -> Dict[str, float]:
    _LOAD.clear()
    with count_s3_reads() as counts:
        t0 = time.perf_counter()
        trainer = _trainer(mb, folder, options, "2ba", autoresume=True, local_dir=local_dir, save_final=False)
        t1 = time.perf_counter()
        trainer.fit()
    first = trainer.state.callbacks[-1]
    assert trainer.state.timestamp.get_value("ba") == 2 and first.at, "the restart did not train"
    trainer.close()
    mib = 2**20
    return {
        "restart": first.at - t0,
        "construct": t1 - t0,
        "load": _LOAD[0],
        "s3_mb": payload_bytes(counts) / mib,
        "s3_all": sum(counts.values()) / mib,
    }


def _fmt(xs: List[float]) -> str:
    return f"{statistics.median(xs):7.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MiB of parameters (state.pt is about this size)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from raytrain_events.checkpoint.run.checkpointer import Checkpointer

    Checkpointer.load = _timed_load(Checkpointer.load)  # type: ignore[method-assign]
    with s3_server() as (root, options), tempfile.TemporaryDirectory() as tmp:
        folder, local_dir = f"{root}/run/checkpoints", os.path.join(tmp, "nvme")
        t = time.perf_counter()
        _trainer(args.mb, folder, options, "1ba", local_dir=local_dir, save_final=True, async_save=False).fit()
        print(f"saved one checkpoint of {args.mb} MiB of parameters to {folder} in {time.perf_counter() - t:.1f} s")
        arms: Dict[str, List[Dict[str, float]]] = {"storage": [], "local tier": []}
        for i in range(args.repeats):
            order = ["storage", "local tier"] if i % 2 == 0 else ["local tier", "storage"]
            for arm in order:
                arms[arm].append(_restart(args.mb, folder, options, local_dir if arm == "local tier" else None))
    print(f"\n{args.mb} MiB state, {args.repeats} interleaved repeats each, median [min-max]:")
    head = f"{'arm':12s} {'restart to first batch':>26s} {'Trainer()':>26s} {'checkpoint load':>26s}"
    print(head + f" {'S3 MiB read':>12s} {'of payload':>11s}")
    for arm, runs in arms.items():
        s3, s3_all = statistics.median(r["s3_mb"] for r in runs), statistics.median(r["s3_all"] for r in runs)
        cols = [_fmt([r[what] for r in runs]) for what in ("restart", "construct", "load")]
        print(f"{arm:12s} " + " ".join(f"{c:>26s}" for c in cols) + f" {s3_all:12.1f} {s3:11.1f}")
    for what in ("restart", "construct", "load"):
        ratio = statistics.median(r[what] for r in arms["storage"]) / statistics.median(
            r[what] for r in arms["local tier"]
        )
        print(f"ratio storage / local tier ({what}): {ratio:.2f}x")
    assert all(r["s3_mb"] == 0 for r in arms["local tier"]), "the local tier read model state from S3"


if __name__ == "__main__":
    main()
