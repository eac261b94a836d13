"""Feeder cost per global batch at 64, 256 and 512 ranks: today's `EpochFeeder` against the first one.

`EpochFeeder` (``raytrain_events/data/ray/feeder.py``) answers one call per rank per chunk of batches.
This drives the REAL class in this process -- no Ray start, no torch: its dataset is a stand-in
whose ``iter_internal_ref_bundles`` yields bundles of fake block references (plain ints) with row
counts, as Ray Data's streaming execution would. W simulated ranks, ``--blocks-per-step`` blocks
per global batch (64 by default, 1,024 rows each, so a global batch is 65,536 rows and each rank's
part spans one or two blocks), ranks in lockstep as DDP keeps them:

- ``per-batch``: each rank asks for one batch per call (the worst case: W calls per global batch);
- ``chunk16``: each rank asks for 16 batches per call (the loader's steady state), so the feeder
  buffers 16 steps of blocks (1,024 blocks) between the slowest and the fastest rank.

Printed: feeder CPU time per global batch (all W ranks' calls; median of ``--repeats`` passes over
``--steps`` global batches), for the code in this checkout and for the first feeder (read from git,
commit ``--old``), and their ratio. Goal: <= 1 ms per global batch at 512 ranks.

Usage::

    python bench/feeder_scale.py                  # W = 64, 256, 512
    python bench/feeder_scale.py --ranks 512 --steps 40 --old b251844
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Iterator, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from raytrain_events.data.ray import feeder as new_feeder  # noqa: E402

ROWS_PER_BLOCK = 1024


class FakeDataset:
    """What `EpochFeeder` uses of a Ray Dataset: ``context`` and the stream of ref bundles."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.context = SimpleNamespace(execution_options=SimpleNamespace(preserve_order=False))

    def iter_internal_ref_bundles(self) -> Iterator[Any]:
        meta = SimpleNamespace(num_rows=ROWS_PER_BLOCK)
        for i in range(self.blocks):
            yield SimpleNamespace(blocks=[(i, meta)], slices=None)


def _old_module(commit: str) -> Any:
    """The feeder as it was at ``commit`` (imported from a temporary file)."""
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{commit}:raytrain_events/ray/feeder.py"], check=True, capture_output=True
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_feeder.py")
    with open(path, "wb") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_feeder", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _pass(module: Any, ranks: int, blocks_per_step: int, steps: int, chunk: int) -> float:
    """CPU seconds per global batch for ``steps`` global batches served to ``ranks`` lockstep ranks."""
    global_batch = blocks_per_step * ROWS_PER_BLOCK
    dataset = FakeDataset(blocks_per_step * (steps + 2 * chunk + 2))
    feeder = module.EpochFeeder(dataset, ranks, global_batch)
    feeder.start_epoch(0, 0, None, 0)
    feeder.batches(0, 0, 0, 0, 1)  # the first pull (the stream's start) is not what is timed
    served = 0
    start = time.process_time()
    for first in range(0, steps, chunk):
        for rank in range(ranks):
            out = feeder.batches(0, 0, rank, first, chunk)
            served += len(out)
    elapsed = time.process_time() - start
    assert served == ranks * steps, (served, ranks * steps)
    stop = getattr(feeder.epochs[(0, 0)], "stop", None)
    if stop is not None:
        stop()
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--blocks-per-step", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old", default="b251844", help="git commit of the feeder to compare with")
    args = parser.parse_args()
    old = _old_module(args.old)
    print(f"blocks per step {args.blocks_per_step}, {ROWS_PER_BLOCK} rows per block, {args.steps} steps")
    print(f"{'ranks':>6} {'calls':>9} {'new ms/batch':>13} {'old ms/batch':>13} {'old/new':>8}")
    for ranks in args.ranks:
        for name, chunk in (("per-batch", 1), ("chunk16", 16)):
            times: List[List[float]] = [[], []]
            for _ in range(args.repeats):
                for i, module in enumerate((new_feeder, old)):
                    times[i].append(_pass(module, ranks, args.blocks_per_step, args.steps, chunk))
            new_ms, old_ms = (statistics.median(t) * 1e3 for t in times)
            print(f"{ranks:>6} {name:>9} {new_ms:>13.3f} {old_ms:>13.3f} {old_ms / new_ms:>7.1f}x", flush=True)


if __name__ == "__main__":
    main()
