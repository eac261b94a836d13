"""Online mixture weights against fixed ones, same token budget: the held-out loss each reaches, over seeds.

On `bench/mixture_tasks.py`'s `ConflictTask` (three sources of points labelled by conflicting
linear rules, held-out rows drawn 0.7/0.2/0.1 from them), every arm trains the same model the same
way through the local `Trainer` with a `MixtureLoader` (a linear classifier, SGD lr 0.5, batches of
32, one epoch of ``--samples`` rows; 512 rows per source in each seed's pools), so the arms differ
only in their weights:

* ``uniform``: 1/3 each;
* ``shares``: the target task's own shares 0.7/0.2/0.1, fixed (known to the bench only: what the
  ``target`` policy estimates);
* ``searched``: the one-shot search's choice (``bench/mixture_search.py``'s `one_shot`: 12
  Dirichlet proxies of the task, the fit, the default criterion and trust region), per seed;
* ``exp3`` and ``doremi``: ``Mixture(online=...)`` from uniform weights, changed at every eval
  (every ``--every`` batches) from each source's loss on its own held-out rows (200 per source);
  ``doremi``'s reference is the ``uniform`` arm's final per-source losses (DoReMi's reference
  model is trained on the uniform mixture);
* ``target``: ``Mixture(online={"policy": "target", ...})`` from uniform weights, the same evals plus
  one on the target task's own held-out rows (``TARGET_ROWS`` rows drawn 0.7/0.2/0.1 from the three
  rules, apart from the final eval set): each decision fits the target's loss as a mixture of the
  sources' losses over the evals so far and moves the weights toward that mixture.

Printed: each arm's held-out loss (the task's 0.7/0.2/0.1 eval set) per seed, the mean and spread,
and the ratio of each arm's mean to uniform's; for the online arms, their final weights.

    python bench/mixture_online.py --seeds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchmetrics  # noqa: E402
from mixture_tasks import ConflictTask  # noqa: E402

from raytrain_events import Trainer  # noqa: E402
from raytrain_events.core.mixture import Mixture  # noqa: E402
from raytrain_events.data.mixture_loader import MixtureLoader  # noqa: E402
from raytrain_events.data.online_mixture import OnlineMixture  # noqa: E402
from raytrain_events.trainer.evaluation import Evaluator  # noqa: E402

POOL, HELD_OUT = 512, 200  # rows per source to train from, and per source to evaluate on
TARGET_ROWS = 600  # the target task's held-out rows the policy 'target' reads (not the final eval set)


class Linear(torch.nn.Module):
    """The task's proxy model: a linear classifier without bias, initialised N(0, 0.3) from the seed."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, 2, bias=False)
        with torch.no_grad():
            self.lin.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(batch["x"])

    def loss(self, outputs: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, batch["y"])

    def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
        return {"loss": torchmetrics.MeanMetric()}

    def update_metric(self, batch: Dict[str, torch.Tensor], outputs: torch.Tensor, metric: Any) -> None:
        metric.update(self.loss(outputs, batch), weight=len(outputs))


def _rows(task: ConflictTask, source: str, n: int, rng: np.random.Generator) -> List[Dict[str, torch.Tensor]]:
    x, y = task._rows(source, n, rng)  # noqa: SLF001 (the task's own row maker: its rules)
    return [{"x": torch.from_numpy(x[i]), "y": torch.tensor(int(y[i]))} for i in range(n)]


def train(
    task: ConflictTask, weights: Dict[str, float], seed: int, samples: int, online: Optional[Dict[str, Any]], every: int
) -> Tuple[float, Dict[str, float], Optional[Dict[str, float]]]:
    """(held-out loss, each source's final eval loss, the final weights of an online arm)."""
    rng = np.random.default_rng([seed, 21])
    pools = {n: _rows(task, n, POOL, rng) for n in task.names}
    held = {n: _rows(task, n, HELD_OUT, rng) for n in task.names}
    if online is not None and online["policy"] == "target":  # its own draw: the final eval set stays unseen
        target_rng = np.random.default_rng([seed, 31])
        held["target"] = [r for n, f in task.target.items() for r in _rows(task, n, int(TARGET_ROWS * f), target_rng)]
    mixture = Mixture(sources={n: POOL for n in task.names}, weights=weights, epoch_size=samples, online=online)
    loader = MixtureLoader(mixture, pools, batch_size=32, seed=seed)
    evaluators = [
        Evaluator(
            label=n, dataloader=torch.utils.data.DataLoader(rows, batch_size=HELD_OUT), eval_interval=f"{every}ba"
        )
        for n, rows in held.items()
    ]
    model = Linear(task.dim, seed)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=evaluators,
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        seed=seed,
    )
    trainer.fit()
    per_source = {n: float(trainer.state.eval_metrics[n]["loss"].compute()) for n in task.names}
    with torch.no_grad():
        held_out = float(torch.nn.functional.cross_entropy(model.lin(task.eval_x), task.eval_y))
    policy = [c for c in trainer.state.callbacks if isinstance(c, OnlineMixture)]
    final = dict(zip(task.names, policy[0].weights)) if policy else None
    return held_out, per_source, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512, help="the token budget: rows trained by every arm")
    parser.add_argument("--every", type=int, default=2, help="batches between evals (an online arm's decisions)")
    parser.add_argument("--rate", type=float, default=2.0, help="the online policies' rate")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from mixture_search import one_shot

    task = ConflictTask(samples=args.samples)
    uniform = {n: 1 / len(task.names) for n in task.names}
    results: Dict[str, List[float]] = {k: [] for k in ("uniform", "shares", "searched", "exp3", "doremi", "target")}
    started = time.perf_counter()
    for seed in range(args.seeds):
        base, reference, _ = train(task, uniform, seed, args.samples, None, args.every)
        results["uniform"].append(base)
        results["shares"].append(train(task, dict(task.target), seed, args.samples, None, args.every)[0])
        searched = one_shot(task, 12, seed)["weights"]
        results["searched"].append(train(task, searched, seed, args.samples, None, args.every)[0])
        line = [f"seed {seed}: uniform {base:.4f}", f"shares {results['shares'][-1]:.4f}"]
        line.append(f"searched {results['searched'][-1]:.4f} ({_w(searched)})")
        for policy, extra in (("exp3", {}), ("doremi", {"reference": reference}), ("target", {"target": "target"})):
            online = {"policy": policy, "rate": args.rate, **extra}
            loss, _, final = train(task, uniform, seed, args.samples, online, args.every)
            results[policy].append(loss)
            line.append(f"{policy} {loss:.4f} (final {_w(final or {})})")
        print("; ".join(line), flush=True)
    print(f"\nheld-out loss over {args.seeds} seeds ({args.samples} rows each, {time.perf_counter() - started:.0f} s):")
    mean_uniform = statistics.mean(results["uniform"])
    for arm, losses in results.items():
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        print(
            f"  {arm:9s} mean {statistics.mean(losses):.4f}  sd {spread:.4f}  x uniform {statistics.mean(losses) / mean_uniform:.3f}"
        )


def _w(weights: Dict[str, float]) -> str:
    return "/".join(f"{weights[n]:.2f}" for n in sorted(weights))


if __name__ == "__main__":
    main()
