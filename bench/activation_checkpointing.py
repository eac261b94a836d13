"""Activation checkpointing's cost and saving: `FSDPConfig(activation_checkpointing=True)` vs off,
on 2 gloo ranks (CPU), the example transformer (examples/transformer_lm.py).

Per arm, per round: a fresh `Trainer` (FSDP, one unit per Block) trains ``--steps`` batches of 8
rows; the step time is the median of the steps after the first 2 (BATCH_START to BATCH_END on
rank 0). Arms alternate (off, on, off, on...) for ``--repeats`` rounds; printed: the median over
rounds with the spread (min-max), the ratio of medians, and the bytes autograd saved for
backward in one forward (each storage once; tests/parallel/ac_workloads.py `SavedActivations`),
which is the forward's peak of activation memory.

Usage::

    python bench/activation_checkpointing.py                    # width 128, 4 blocks, sequence 128
    python bench/activation_checkpointing.py --repeats 2 --steps 6   # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _rank(rank: int, world_size: int, checkpointing: bool, steps: int, sizes: Dict[str, int]) -> Dict[str, Any]:
    from tests.parallel.ac_workloads import SavedActivations, StepTimes, ac_trainer, timed_fit

    timer, saved = StepTimes(), SavedActivations()
    return timed_fit(ac_trainer(rank, checkpointing, steps, [timer, saved], sizes), timer, saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.parallel.spawn import run_ranks

    sizes = dict(width=args.width, depth=args.depth, length=args.length, heads=4)
    got: Dict[str, List[Dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            got[name].append(run_ranks(2, _rank, name == "on", args.steps, sizes)[0])
    print(
        f"transformer {sizes}, batch 8 rows, 2 gloo ranks, FSDP per Block, {args.repeats} rounds x {args.steps} steps"
    )
    medians = {}
    for name, rounds in got.items():
        times = [r["step_s"] * 1000 for r in rounds]
        medians[name] = statistics.median(times)
        print(
            f"activation_checkpointing {name:>3}: step {medians[name]:7.1f} ms (spread {min(times):.1f}-{max(times):.1f}), "
            f"saved for backward {rounds[0]['saved'] / 2**20:6.2f} MiB per forward"
        )
    ratio = got["on"][0]["saved"] / got["off"][0]["saved"]
    print(f"on/off: step time x{medians['on'] / medians['off']:.2f}, saved activations x{ratio:.2f}")


if __name__ == "__main__":
    main()
