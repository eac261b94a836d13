"""Training held by a metrics report while a checkpoint uploads: RayTrainer on real local Ray, one worker.

A save is registered with Ray in a report whose upload function waits for the save's commit
(`ray.checkpointing.report_with_checkpoint`, Ray's ASYNC upload mode: one upload thread), so the
training thread goes on while the checkpoint is written. Ray hands reports to its controller in
order, one at a time: a plain (SYNC) ``ray.train.report`` made meanwhile waits for that commit,
holding training for the rest of the upload, and then for the controller to take each report
before it. A report without a checkpoint goes out in Ray's ASYNC mode and waits in Ray's thread
instead (`RayReporter._send`).

The run: a model whose state is ``--mb`` MiB (a buffer), ``--batches`` batches of ``--batch-ms`` of
stand-in compute each, a save every ``--save-every`` batches to local disk, each save's write made
``--upload-s`` slower (a slow store: an upload of minutes for a 100 GB checkpoint), a report every
``--every-s`` seconds (RayTrainer's ``report_every_s``; its default is 10 s). Rank 0 records each
batch's start and each ``ray.train.report``'s time in training and mode; printed: those reports,
the train time (first batch start to last), and the batches' gaps over 4x the stand-in compute
(held) and their sum. Compare two trees in one go, alternated, each from its own directory (Ray's
workers import the project from the driver's working directory):

    cd /path/to/other/tree && PYTHONPATH=$PWD python /path/to/bench/report_blocking.py --upload-s 6 --save-every 800
    cd /path/to/this/tree && PYTHONPATH=$PWD python bench/report_blocking.py --upload-s 6 --save-every 800

Measured (2026-12-07, quiet, 2 alternated pairs, 1,600 batches of 10 ms, a save at 800 uploading 6 s, reports every
2.5 s): before (plain reports) 26.62 / 26.69 s of training, held 5 times for 8.98 / 9.25 s (the first report after
the save 3.7 s: the rest of the upload; the next four 2.0, 1.5, 1.0, 0.5 s: each waiting for the controller to take
the one before); now 18.24 / 17.53 s, held 0 times (1.47x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _run(args, scratch: str) -> dict:
    import ray
    import ray.data
    import torch
    from ray import cloudpickle

    from raytrain_events import Callback, RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.models import ClassifierModel

    mb, batch_s, upload_s = args.mb, args.batch_ms / 1000, args.upload_s
    out = os.path.join(scratch, "starts.json")

    class Big(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 2)
            self.register_buffer("state", torch.zeros(mb * 2**18))  # mb MiB of float32 in every save

        def forward(self, x):
            return self.net(x)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list = []
            self.reports: list = []

        def fit_start(self, state, logger) -> None:
            import raytrain_events
            from raytrain_events.checkpoint.run.checkpointer import find_checkpointer

            print("worker tree:", os.path.dirname(os.path.dirname(raytrain_events.__file__)), flush=True)

            checkpointer = find_checkpointer(state)
            write = checkpointer._write  # the background save's write: slowed to an upload of --upload-s

            def slow_write(*a, **k):
                time.sleep(upload_s)
                return write(*a, **k)

            checkpointer._write = slow_write
            import ray.train

            report = ray.train.report  # each report's time in training, and its mode

            def timed_report(*a, **k):
                t = time.monotonic()
                report(*a, **k)
                mode = getattr(k.get("checkpoint_upload_mode"), "name", "SYNC")
                self.reports.append((t, time.monotonic() - t, mode, k.get("checkpoint") is not None))

            ray.train.report = timed_report

        def batch_start(self, state, logger) -> None:
            self.starts.append(time.monotonic())
            time.sleep(batch_s)  # stand-in compute

        def fit_end(self, state, logger) -> None:
            if state.rank == 0:
                with open(out, "w") as f:
                    json.dump({"starts": self.starts, "reports": self.reports}, f)

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    import numpy as np

    rows = [{"x": np.full(8, i % 7, dtype=np.float32), "y": i % 2} for i in range(args.batches * 4)]
    RayTrainer(
        model=lambda: ClassifierModel(Big(), num_classes=2),
        optimizers=lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        datasets={"train": ray.data.from_items(rows)},
        max_duration="1ep",
        batch_size=4,
        num_workers=1,
        callbacks=lambda: [Clock()],
        report_every_s=args.every_s,
        storage_path=os.path.join(scratch, "runs"),
        run_name="blocking",
        checkpoint=CheckpointConfig(save_interval=f"{args.save_every}ba", keep=2, save_every_n_seconds=None),
    ).fit()
    with open(out) as f:
        record = json.load(f)
    starts = record["starts"]
    t0 = starts[0]
    print(
        "reports (seconds into training, seconds in training, mode, with a checkpoint):",
        [(round(t - t0, 2), round(d, 2), m, c) for t, d, m, c in record["reports"]],
    )
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    held = [g for g in gaps if g > 4 * batch_s]
    at = [(i + 1, round(g, 2), round(starts[i] - starts[0], 2)) for i, g in enumerate(gaps) if g > 4 * batch_s]
    print("held at (batch, seconds held, seconds into training):", at)
    return {"train_s": starts[-1] - starts[0], "held": len(held), "held_s": sum(held), "batches": len(starts)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1)
    parser.add_argument("--batches", type=int, default=1600)
    parser.add_argument("--batch-ms", type=float, default=10.0)
    parser.add_argument("--save-every", type=int, default=400)
    parser.add_argument("--upload-s", type=float, default=3.0, help="each save's write is this much slower")
    parser.add_argument("--every-s", type=float, default=2.5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    import ray

    # The workers import the project from the tree on PYTHONPATH too (else they find the installed one).
    tree = os.environ.get("PYTHONPATH", "")
    ray.init(address="local", include_dashboard=False, num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": tree}})
    import raytrain_events

    print(f"tree: {os.path.dirname(os.path.dirname(raytrain_events.__file__))}")
    results = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as scratch:
            results.append(_run(args, scratch))
        res = results[-1]
        print(
            f"repeat {r}: train {res['train_s']:.2f} s for {res['batches']} batches "
            f"(stand-in compute {res['batches'] * args.batch_ms / 1000:.2f} s); "
            f"held {res['held']} times, {res['held_s']:.2f} s",
            flush=True,
        )
    train = [r["train_s"] for r in results]
    held = [r["held_s"] for r in results]
    print(
        f"median train {statistics.median(train):.2f} s (min {min(train):.2f}, max {max(train):.2f}); "
        f"median held {statistics.median(held):.2f} s (min {min(held):.2f}, max {max(held):.2f})"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
