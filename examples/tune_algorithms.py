"""Sweep algorithm sets with Ray Tune: which of Composer-style methods helps a small digits MLP?

Each trial trains the same model on scikit-learn's ``load_digits`` (ships with scikit-learn, no
download) with `RayTrainer` on Ray Train workers, with one algorithm set; ASHA stops weak trials
early on the global sample count (``time/sample``). The table of trials is printed at the end.

    python examples/tune_algorithms.py                  # embedded local Ray, a few minutes on a CPU
    python examples/tune_algorithms.py --fresh          # a new sweep instead of resuming the last one
    RAY_ADDRESS=auto python examples/tune_algorithms.py --workers 2   # on a running cluster

Run it again with the same ``--name`` and it resumes (a finished sweep just prints its table).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import numpy as np
import torch

from raytrain_events.models import ClassifierModel
from raytrain_events.ray.cluster import ensure_ray
from raytrain_events.tune import algorithm_sets_grid, sweep

ALGORITHM_SETS = [
    [],
    ["label_smoothing"],
    [{"name": "mixup", "alpha": 0.2}],
    [{"name": "label_smoothing", "smoothing": 0.1}, {"name": "gradient_clipping", "clipping_threshold": 1.0}],
]


def digits_rows(seed: int = 0):
    """Digits as rows ``{"x": float32[64], "y": int}``, split 80/20."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    split = int(0.8 * len(x))
    rows = [{"x": x[i], "y": int(y[i])} for i in order]
    return rows[:split], rows[split:]


def make_model(config):
    hidden = config.get("hidden", 64)
    net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    return ClassifierModel(net, num_classes=10)


def make_optimizer(model, config):
    return torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)


def checkpoint_config():
    """Per-trial checkpoints (each epoch, the newest kept), when the checkpointing module is available."""
    try:
        import raytrain_events.ray.checkpointing.checkpointing  # noqa: F401
        from raytrain_events.checkpoint import CheckpointConfig
    except ImportError:
        return None
    return CheckpointConfig(save_interval="1ep", keep=1, autoresume=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="runs", help="where sweeps are stored (path or fsspec URL)")
    parser.add_argument("--name", default="tune_algorithms", help="the sweep's name; the same name resumes")
    parser.add_argument("--fresh", action="store_true", help="start a new sweep (a timestamped name)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers per trial")
    parser.add_argument("--lr", type=float, nargs="+", default=[0.05], help="learning rates to cross with the sets")
    parser.add_argument("--max-concurrent", type=int, default=None, help="default: what the cluster's CPUs hold")
    parser.add_argument(
        "--sets", type=int, default=len(ALGORITHM_SETS), help="sweep only the first N algorithm sets (a quick run)"
    )
    args = parser.parse_args()

    import ray.data
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    ensure_ray()  # the cluster if there is one, else an embedded local Ray on 127.0.0.1
    train_rows, eval_rows = digits_rows()
    n_train = len(train_rows)
    name = args.name + (datetime.datetime.now().strftime("-%Y%m%d-%H%M%S") if args.fresh else "")

    start = time.time()
    result = sweep(
        trainer=dict(
            model=make_model,
            optimizers=make_optimizer,
            datasets={"train": ray.data.from_items(train_rows), "eval": ray.data.from_items(eval_rows)},
            max_duration=f"{args.epochs}ep",
            batch_size=args.batch_size,
            num_workers=args.workers,
            report_interval="1ep",  # one report per epoch, after its eval
            # Digits fit in memory: each trial's worker group splits the eval set once instead of a streaming
            # split (a Ray Data coordinator actor per trial, and a streaming execution at every eval).
            deterministic_split=True,
            checkpoint=checkpoint_config(),
        ),
        param_space={
            "algorithms": algorithm_sets_grid(ALGORITHM_SETS[: max(1, args.sets)]),
            "lr": tune.grid_search(args.lr) if len(args.lr) > 1 else args.lr[0],
        },
        metric="metrics/eval/accuracy",
        mode="max",
        # Rungs at 2 and 4 epochs of global samples; the top half goes on. Trials reaching max_t end
        # on their own (stop_last_trials=False), with their final eval and checkpoint.
        scheduler=ASHAScheduler(
            time_attr="time/sample",
            max_t=args.epochs * n_train,
            grace_period=2 * n_train,
            reduction_factor=2,
            stop_last_trials=False,
        ),
        max_concurrent_trials=args.max_concurrent,
        storage_path=args.storage,
        name=name,
        verbose=1,  # one line per trial event, then the results table sorted by the metric
    )
    from raytrain_events.report import write_report

    report = write_report(result.path)  # the algorithm sets compared: sweep.png + report.html
    print()
    if result.best is None:  # every trial failed: the table above says how; Tune logged each error
        sys.exit(f"no trial reported {result.metric}: see the errors above (sweep folder: {result.path})")
    print(f"best algorithm set: {result.best_label}  ({result.metric} = {result.best[result.metric]:.4f})")
    print(f"best trial samples: {result.best.get('time/sample')} (global, all workers)")
    print(f"best checkpoint:    {result.best_checkpoint}")
    print(f"sweep folder:       {result.path}")
    print(f"comparison figure:  {report['images'][0] if report['images'] else '(no metric reported)'}")
    print(f"report:             {report['html']}")
    print(f"took {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
