"""Population-based training over algorithm sets: trials copy better trials mid-run and switch sets.

A population of trials trains the digits MLP of ``tune_algorithms.py`` (scikit-learn's
``load_digits``, shipped with scikit-learn, no download) with `RayTrainer`, one algorithm set and
learning rate each. Every epoch of global samples, Tune's PBT (`pbt_scheduler`) has the bottom
quarter of the trials copy a top trial: the copy loads the top trial's committed checkpoint
(weights, optimizer moments, the exact global Timestamp and data position) into a new run and
goes on with a perturbed config: a neighbouring algorithm set of ``ALGORITHM_SETS`` and a
neighbouring learning rate. The table at the end has a ``copied`` column (``trial@samples``), and
the run report (``report.html``) shows every trial's lineage.

    python examples/tune_pbt.py                      # embedded local Ray, a few minutes on a CPU
    python examples/tune_pbt.py --lr 0 0.05 0 --sets 1 --epochs 3    # a bad population the good trial fixes
    RAY_ADDRESS=auto python examples/tune_pbt.py --workers 2         # on a running cluster

Each run is a new sweep (a timestamped name) unless ``--name`` is given; the same ``--name`` resumes it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from ray import cloudpickle as ray_cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_algorithms  # noqa: E402  (the digits data, model and optimizer of the plain sweep example)
from tune_algorithms import digits_rows, make_model, make_optimizer  # noqa: E402

from raytrain_events.checkpoint import CheckpointConfig  # noqa: E402
from raytrain_events.ray.cluster import ensure_ray  # noqa: E402
from raytrain_events.tune import algorithm_sets_grid, pbt_scheduler, sweep  # noqa: E402

ray_cloudpickle.register_pickle_by_value(tune_algorithms)  # Ray workers get these functions without the file

#: The sets a trial may switch to, in the order PBT's neighbours are taken (one step left or right).
ALGORITHM_SETS = [
    ["label_smoothing"],
    [],
    [{"name": "gradient_clipping", "clipping_threshold": 1.0}],
    [{"name": "label_smoothing", "smoothing": 0.1}, {"name": "gradient_clipping", "clipping_threshold": 1.0}],
]
#: The population starts on the first ``--sets`` of these (no algorithm first).
STARTING_SETS = [ALGORITHM_SETS[1], ALGORITHM_SETS[0], ALGORITHM_SETS[2], ALGORITHM_SETS[3]]
#: The learning rates a trial may move to (a neighbour in this list).
LEARNING_RATES = [0.005, 0.01, 0.02, 0.05, 0.1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="runs", help="where sweeps are stored (path or fsspec URL)")
    parser.add_argument("--name", default=None, help="the sweep's name (default: tune_pbt-<time>); the same resumes")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers per trial")
    parser.add_argument("--sets", type=int, default=2, help="start the population on the first N sets")
    parser.add_argument(
        "--lr", type=float, nargs="+", default=[0.005, 0.05], help="starting learning rates (crossed with the sets)"
    )
    args = parser.parse_args()

    import ray.data
    from ray import tune

    population = max(1, args.sets) * len(args.lr)
    # A local Ray gets a CPU per worker of the whole population (PBT compares trials that run
    # side by side) and two more for Ray Data.
    ensure_ray(min_cpus=population * args.workers + 2)
    train_rows, eval_rows = digits_rows()
    n_train = len(train_rows)
    name = args.name or datetime.datetime.now().strftime("tune_pbt-%Y%m%d-%H%M%S")

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
            # A checkpoint with every report: PBT copies the one reported with a top trial's latest result.
            checkpoint=CheckpointConfig(save_interval="1ep"),
        ),
        param_space={
            "algorithms": algorithm_sets_grid(STARTING_SETS[: max(1, args.sets)]),
            "lr": tune.grid_search(args.lr),
        },
        metric="metrics/eval/accuracy",
        mode="max",
        scheduler=pbt_scheduler(
            f"{n_train}sp",  # one epoch of global samples, whatever the number of workers
            algorithm_sets=ALGORITHM_SETS,
            lr=LEARNING_RATES,
            quantile_fraction=0.25,
            resample_probability=0.25,
        ),
        max_concurrent_trials=population,
        storage_path=args.storage,
        name=name,
        verbose=1,  # one line per trial event (copies included), then the table with its `copied` column
    )
    from raytrain_events.report import write_report

    report = write_report(result.path)
    print()
    if result.best is None:
        sys.exit(f"no trial reported {result.metric}: see the errors above (sweep folder: {result.path})")
    copies = [(row["trial_id"], step) for row in result.rows for step in row["lineage"]]
    print(f"copies:          {len(copies)}")
    for trial_id, step in copies:
        print(
            f"  {trial_id} copied {step['copied_trial']} at {step['counters']['sample']} samples, "
            f"sets {step['from_algorithms']} -> {step['algorithms']}"
        )
    print(f"best trial:      {result.best['trial_id']} ({result.best_label}, lr={result.best['config']['lr']})")
    print(f"best {result.metric}: {result.best[result.metric]:.4f}")
    print(f"best checkpoint: {result.best_checkpoint}")
    print(f"sweep folder:    {result.path}")
    print(f"report:          {report['html']}")
    print(f"took {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
