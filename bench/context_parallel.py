"""Context parallelism's saving and cost: `FSDPConfig(context_parallel=2)` vs the same rows whole
(``"ddp"``, each rank of the pair training the pair's rows), on 2 gloo ranks (CPU), the example
transformer (examples/transformer_lm.py) with a long sequence.

Per arm, per round: a fresh `Trainer` trains ``--steps`` batches of 4 rows; the step time is the
median of the steps after the first 2 (BATCH_START to BATCH_END on rank 0). Arms alternate for
``--repeats`` rounds; printed: the median over rounds with the spread (min-max), and the bytes
autograd saved for backward in one forward on rank 0 (each storage once; the forward's peak of
activation memory; tests/parallel/ac_workloads.py `SavedActivations`).

Usage::

    python bench/context_parallel.py                    # width 128, 2 blocks, sequence 1024
    python bench/context_parallel.py --length 512 --repeats 2 --steps 5   # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

ARMS = {"whole (ddp)": "ddp", "context_parallel=2": {"shard_modules": ["Block"], "context_parallel": 2}}


def _rank(rank: int, world_size: int, arm: str, steps: int, sizes: Dict[str, int]) -> Dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events import Trainer
    from tests.parallel.ac_workloads import SavedActivations, StepTimes, timed_fit

    timer, saved = StepTimes(), SavedActivations()
    torch.manual_seed(0)
    model = TransformerLM(vocab=256, **sizes)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(4 * steps, vocab=256, length=sizes["length"], seed=1), batch_size=4),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        parallelism=ARMS[arm],
        callbacks=[timer, saved],
    )
    return timed_fit(trainer, timer, saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.parallel.spawn import run_ranks

    sizes = dict(width=args.width, depth=args.depth, length=args.length, heads=4)
    got: Dict[str, List[Dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            got[arm].append(run_ranks(2, _rank, arm, args.steps, sizes)[0])
    print(f"transformer {sizes}, batch 4 rows, 2 gloo ranks, {args.repeats} rounds x {args.steps} steps")
    for arm, rounds in got.items():
        times = [r["step_s"] * 1000 for r in rounds]
        print(
            f"{arm:>18}: step {statistics.median(times):8.1f} ms (spread {min(times):.1f}-{max(times):.1f}), "
            f"saved for backward {rounds[0]['saved'] / 2**20:7.2f} MiB per forward per rank"
        )


if __name__ == "__main__":
    main()
