"""Search the data mixture: short proxy runs with sampled weights, a regression, and the predicted best mixture.

Three synthetic sources of labelled points in 8 dimensions, and a held-out task (points in all 8
dimensions, labelled by one fixed linear rule):

* ``help``: the task's rule on dimensions 0-5 (dimensions 6-7 are 0): most of what the task needs;
* ``small``: the same rule on dimensions 6-7 only: the task needs it (without it two of the eight
  weights stay untrained), in a smaller share than ``help``;
* ``noise``: random labels: every row of it makes the held-out loss worse.

The search (RegMix-style): ``--trials`` proxy runs of ``--proxy-samples`` samples each, with weights
drawn from a Dirichlet on the simplex (`mixture_space`), then a Gaussian-process fit of the held-out
cross-entropy as a function of the weights (`regmix_search`: held-out error by 5-fold
cross-validation), the predicted best mixture written as a stages config (``Mixture.to_dict()``,
YAML), and that config read back unchanged for full runs of ``--full-samples``, compared with
uniform weights over ``--seeds`` seeds. It prints the trials, the fit, the chosen mixture and the
margin.

    python examples/tune_mixture.py                  # proxies with the local Trainer: no Ray, ~25 CPU-s
    python examples/tune_mixture.py --ray            # proxies as a Ray Tune sweep of RayTrainer runs

The full runs use the local `Trainer` either way (the stages config is all they need from the search).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch

from raytrain_events import DataSpec, Mixture, MixtureLoader, Trainer
from raytrain_events.models import ClassifierModel
from raytrain_events.tune import mixture_space, read_mixture_config, regmix_search, write_mixture_config

DIM = 8
ROWS = 4000  # rows per source (more than any run reads: every row once)
EVAL_ROWS = 1000
SOURCES = ("help", "noise", "small")
UNIFORM = {name: 1 / 3 for name in SOURCES}
METRIC = "metrics/eval/cross_entropy"


def _rule() -> np.ndarray:
    return np.random.default_rng(1234).normal(size=DIM)


def make_rows(source: str, n: int, seed: int) -> List[Dict[str, Any]]:
    """``n`` rows of ``source`` (``help``, ``small``, ``noise`` or ``eval``: the held-out task)."""
    rng = np.random.default_rng([seed, SOURCES.index(source) if source in SOURCES else 9])
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    if source == "help":
        x[:, 6:] = 0
    elif source == "small":
        x[:, :6] = 0
    y = (x @ _rule() > 0).astype(np.int64)
    if source == "noise":
        y = rng.integers(0, 2, size=n)
    return [{"x": torch.from_numpy(x[i]), "y": int(y[i])} for i in range(n)]


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: List[Dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.rows[i]


def base_mixture(samples: int) -> Mixture:
    """Uniform weights over the three sources, ``samples`` rows an epoch (the searched weights replace these)."""
    return Mixture(sources={name: ROWS for name in SOURCES}, weights=dict(UNIFORM), epoch_size=samples)


def make_model(config: Optional[Mapping[str, Any]] = None) -> ClassifierModel:
    torch.manual_seed(int((config or {}).get("model_seed", 0)))
    return ClassifierModel(torch.nn.Linear(DIM, 2, bias=False), num_classes=2)


def make_optimizer(model: torch.nn.Module, config: Optional[Mapping[str, Any]] = None) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=float((config or {}).get("lr", 0.5)))


def train_locally(mixture: Mixture, *, seed: int, data_seed: int = 0, batch_size: int = 32) -> float:
    """One run of ``mixture`` (one epoch: ``mixture.epoch_size`` samples) with the local `Trainer`; its held-out loss."""
    sources = {name: Rows(make_rows(name, ROWS, data_seed)) for name in SOURCES}
    loader = MixtureLoader(mixture, sources, batch_size=batch_size)
    eval_rows = make_rows("eval", EVAL_ROWS, data_seed + 1)
    model = make_model({"model_seed": seed})
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader),
        eval_dataloader={"eval": torch.utils.data.DataLoader(Rows(eval_rows), batch_size=250)},
        max_duration="1ep",
        optimizers=make_optimizer(model),
        seed=seed,
    )
    trainer.fit()
    return float(trainer.logger.metrics[METRIC])


def proxy_trials_locally(weights: List[Dict[str, float]], samples: int) -> List[Dict[str, Any]]:
    """The proxy trials without Ray: rows shaped like a `SweepResult`'s."""
    from raytrain_events.tune.simplex import trial_mixture

    rows = []
    for i, w in enumerate(weights):
        loss = train_locally(trial_mixture(base_mixture(samples), w), seed=0)
        rows.append({"trial_id": f"proxy_{i:02d}", "status": "completed", "config": {"mixture": w}, METRIC: loss})
    return rows


def write_parquet_sources(folder: str, data_seed: int = 0) -> Dict[str, str]:
    """Each source as one Parquet file (``x``: 8 float32, ``y``), for `RayTrainer`'s seekable mixture sources."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {}
    for name in SOURCES:
        rows = make_rows(name, ROWS, data_seed)
        table = pa.table(
            {
                "x": pa.array([r["x"].tolist() for r in rows], pa.list_(pa.float32(), DIM)),
                "y": pa.array([r["y"] for r in rows], pa.int64()),
            }
        )
        paths[name] = os.path.join(folder, f"{name}.parquet")
        pq.write_table(table, paths[name], row_group_size=100)
    return paths


def proxy_trials_on_ray(
    space: Any, samples: int, storage: str, batch_size: int, *, scheduler: Any = None, **trainer: Any
) -> Any:
    """The proxy trials as a Ray Tune sweep: each trial a `RayTrainer` run on its sampled mixture.

    Its sources are Parquet files (`ParquetRowGroups`: seekable, so a resume or a PBT copy enters
    each at its cursor); the held-out task and one eval set per source give ``metrics/eval/...``
    and ``metrics/eval_<source>/...``. ``scheduler``: a Tune scheduler (``pbt_scheduler(...,
    mixture=mixture_space(...))`` for PBT over the weights); ``trainer``: more `RayTrainer` options
    (a PBT sweep needs ``checkpoint=CheckpointConfig(save_interval=...)``).
    """
    import sys

    import ray
    from ray import cloudpickle as ray_cloudpickle

    from raytrain_events.ray import ParquetRowGroups
    from raytrain_events.ray.cluster import ensure_ray
    from raytrain_events.tune import sweep

    if __name__ != "__main__" and __name__ in sys.modules:  # imported: trials get these functions, not the file
        ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (__main__ and unlisted modules go by value)
    ensure_ray()
    folder = tempfile.mkdtemp(prefix="tune_mixture-data-")
    datasets: Dict[str, Any] = {name: ParquetRowGroups(path) for name, path in write_parquet_sources(folder).items()}

    def eval_set(source: str, seed: int) -> Any:
        return ray.data.from_items([{"x": r["x"].numpy(), "y": r["y"]} for r in make_rows(source, EVAL_ROWS, seed)])

    datasets["eval"] = eval_set("eval", 1)
    for name in SOURCES:
        datasets[f"eval_{name}"] = eval_set(name, 2)
    return sweep(
        trainer=dict(
            model=make_model,
            optimizers=make_optimizer,
            datasets=datasets,
            mixture=base_mixture(samples),
            max_duration="1ep",
            batch_size=batch_size,
            num_workers=1,
            report_interval="1ep",
            report_every_s=None,
            get_num_tokens_in_batch=lambda batch: int(batch["y"].numel()) * DIM,  # a token per feature
            # The eval sets (small, in memory) split once per worker group instead of a streaming split per
            # set and group (a Ray Data coordinator actor each, and a streaming execution at every eval).
            deterministic_split=True,
        )
        | trainer,
        param_space={"mixture": space},
        scheduler=scheduler,
        metric=METRIC,
        mode="min",
        storage_path=storage,
        verbose=0,
    )


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=16, help="proxy runs (sampled mixtures)")
    parser.add_argument("--proxy-samples", type=int, default=512, help="samples per proxy run")
    parser.add_argument("--full-samples", type=int, default=2048, help="samples per full run")
    parser.add_argument("--seeds", type=int, default=3, help="full runs per mixture (model seeds)")
    parser.add_argument("--out", default=None, help="where the chosen stages config goes (default: a temp dir)")
    parser.add_argument("--ray", action="store_true", help="run the proxies as a Ray Tune sweep of RayTrainer runs")
    parser.add_argument("--storage", default="runs", help="the sweep's storage (with --ray)")
    args = parser.parse_args(argv)

    space = mixture_space(base_mixture(args.proxy_samples), concentration=1.0, num_samples=args.trials, seed=0)
    if args.ray:
        result = proxy_trials_on_ray(space, args.proxy_samples, args.storage, batch_size=32)
        print(result.to_table())
    else:
        rows = proxy_trials_locally(space["grid_search"], args.proxy_samples)
        result = argparse.Namespace(rows=rows, metric=METRIC, mode="min")
    for row in sorted(result.rows, key=lambda r: r.get(METRIC) or math.inf):
        print(f"{row['trial_id']}  {row['config']['mixture']}  {METRIC}={row.get(METRIC)}")
    found = regmix_search(result, base_mixture(args.full_samples), metric=METRIC)
    print(found.report())

    out = args.out or os.path.join(tempfile.mkdtemp(prefix="tune_mixture-"), "mixture.yaml")
    write_mixture_config(found.mixture, out)
    chosen = read_mixture_config(out)  # the full run reads the stages config unchanged
    assert chosen == found.mixture
    seeds = range(args.seeds)
    chosen_losses = [train_locally(chosen, seed=s) for s in seeds]
    uniform_losses = [train_locally(base_mixture(args.full_samples), seed=s) for s in seeds]
    margin = statistics.mean(uniform_losses) - statistics.mean(chosen_losses)
    print(f"stages config: {out}")
    print(
        f"full runs ({args.full_samples} samples, {args.seeds} seeds): chosen {statistics.mean(chosen_losses):.4f}, "
        f"uniform {statistics.mean(uniform_losses):.4f}: the chosen mixture's held-out loss is lower by {margin:.4f}"
    )
    return {
        "found": found,
        "config": out,
        "chosen_losses": chosen_losses,
        "uniform_losses": uniform_losses,
        "margin": margin,
        "result": result,
    }


if __name__ == "__main__":
    main()
