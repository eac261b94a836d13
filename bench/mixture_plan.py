"""Mixture costs: the plan (resume cursors, rows per second) and the local loader against a plain DataLoader.

Three measurements, each the median of ``--repeats`` (thread CPU time, so a busy shared machine
counts only our own work):

* **resume**: ``plan.cursors(epoch, position)`` deep in an epoch of sources with 1e9/1e8/1e7 rows
  (and ``--sources`` of them): what a resume costs to find every source's position;
* **plan rows/s**: ``plan.rows`` over batches of ``--batch`` global positions (the (source, row)
  of each, nothing read): the CPU a data path spends per row on the order;
* **loader**: one epoch of `MixtureLoader` over three in-memory sources against
  ``torch.utils.data.DataLoader`` over one source of the same rows (same batch size and collate):
  the local path's mixing overhead;
* **ray stream**: the feeder side of ``RayTrainer(mixture=...)``: `MixtureSource`'s mixed stream
  (the plan walk and one slice per run of same-source positions) over three stand-in seekable
  sources of 1e6 rows in row groups of 1,000 (no Ray, no reads: the stream's own CPU per
  position), in the run's order (each global batch of 4,096 listed by source, as the feeder asks
  for it) and in the plan's own interleaved order (each source's runs of 1-3 positions), and a
  rank's per-batch count (``plan.batch_sources`` over its positions);
* **batch assembly**: a rank's 1,024-row batch of 1,024 int32 tokens per row made from the slices
  a 3-source mixture gives -- in the plan's interleaved order (runs of 1-3 rows of each source's
  block: what a rank joined before the run's order listed each global batch by source) and in the
  run's order (at most one slice per source) -- against one slice of one block, as the loader
  joins them (a slice of a block each, concatenated, then ``table_to_torch``).

Usage::

    python bench/mixture_plan.py                 # all three, 5 repeats
    python bench/mixture_plan.py --sources 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List


def _clock() -> float:
    return time.thread_time()


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = _clock()
        fn()
        times.append(_clock() - start)
    return statistics.median(times)


def resume_cost(sources: int, repeats: int) -> Dict[str, Any]:
    from raytrain_events.core.mixture import Mixture

    sizes = [10 ** (9 - i % 3) for i in range(sources)]
    mixture = Mixture(
        sources={f"s{i}": n for i, n in enumerate(sizes)},
        stages={"0dur": {f"s{i}": 1 + i % 3 for i in range(sources)}, "0.5dur": {"s0": 1, "s1": 1}},
    )
    plan = mixture.plan(seed=1, total_samples=4 * mixture.epoch_size)
    position = mixture.epoch_size * 3 // 4  # in the second stage
    seconds = _median(lambda: [plan.cursors(1, position + k) for k in range(100)], repeats) / 100
    return {"sources": sources, "epoch_size": mixture.epoch_size, "cursors_us": round(seconds * 1e6, 1)}


def plan_rows_per_s(sources: int, batch: int, repeats: int) -> Dict[str, Any]:
    from raytrain_events.core.mixture import Mixture

    sizes = [10 ** (9 - i % 3) for i in range(sources)]
    mixture = Mixture(sources={f"s{i}": n for i, n in enumerate(sizes)}, weights={f"s{i}": 1 for i in range(sources)})
    plan = mixture.plan(seed=1)
    start = mixture.epoch_size // 3
    batches = 20
    seconds = _median(
        lambda: [plan.rows(0, start + b * batch, start + (b + 1) * batch) for b in range(batches)], repeats
    )
    return {"sources": sources, "batch": batch, "plan_rows_per_s": round(batches * batch / seconds)}


def loader_overhead(repeats: int, batch: int) -> Dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from raytrain_events.core.mixture import Mixture
    from raytrain_events.data.mixture_loader import MixtureLoader

    rows = {"web": 6000, "code": 3000, "math": 1000}
    data = {
        name: [{"ids": torch.full((64,), i, dtype=torch.int32)} for _ in range(n)]
        for i, (name, n) in enumerate(rows.items())
    }
    single: List[Any] = [row for name in rows for row in data[name]]
    mixture = Mixture(sources=rows, weights={"web": 0.6, "code": 0.3, "math": 0.1})
    loader = MixtureLoader(mixture, data, batch_size=batch, seed=0)
    plain = DataLoader(single, batch_size=batch, shuffle=True)  # type: ignore[arg-type]
    ours = _median(lambda: sum(1 for _ in loader), repeats)
    theirs = _median(lambda: sum(1 for _ in plain), repeats)
    total = sum(rows.values())
    return {
        "rows": total,
        "batch": batch,
        "mixture_loader_rows_per_s": round(total / ours),
        "dataloader_rows_per_s": round(total / theirs),
        "ratio": round(ours / theirs, 2),
    }


class _FakeSource:
    """A seekable source (``count``/``stream``) of ``rows`` rows in row groups of ``group`` rows; refs are ints."""

    def __init__(self, rows: int, group: int) -> None:
        self.rows, self.group = rows, group

    def count(self) -> int:
        return self.rows

    def stream(self, seed: Any, epoch: int, row: int, window_rows: int = 0, global_batch: Any = None) -> Any:
        from types import SimpleNamespace

        first = row // self.group * self.group

        def bundles() -> Any:
            for start in range(first, self.rows, self.group):
                n = min(self.group, self.rows - start)
                yield SimpleNamespace(
                    blocks=[(start, SimpleNamespace(num_rows=n))], slices=[SimpleNamespace(start_offset=0, num_rows=n)]
                )

        return bundles(), first, 0


def ray_stream(
    repeats: int, positions: int = 200_000, rank_batch: int = 1024, global_batch: int = 4096
) -> Dict[str, Any]:
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.data.ray.mixture_source import MixtureSource

    sizes = {"web": 1_000_000, "code": 1_000_000, "math": 1_000_000}
    mixture = Mixture(
        sources=sizes,
        stages={"0dur": {"web": 0.6, "code": 0.3, "math": 0.1}, "0.5dur": {"web": 1, "code": 1, "math": 1}},
    )
    args = {"mixture": mixture.to_dict(), "seed": 0, "total_samples": mixture.epoch_size, "global_batch": 4096}
    source = MixtureSource({n: _FakeSource(r, 1000) for n, r in sizes.items()}, args, 0)
    start = mixture.epoch_size // 2 - positions // 2  # across the stage boundary
    pieces: List[int] = []

    def stream(batch: Any) -> None:
        bundles, _, _ = source.stream(None, 0, start, global_batch=batch)
        taken = n = 0
        for bundle in bundles:
            taken += bundle.slices[0].num_rows
            n += 1
            if taken >= positions:
                break
        pieces.append(n)

    out: Dict[str, Any] = {"positions": positions, "global_batch": global_batch}
    for order, batch in (("run_order", global_batch), ("plan_order", None)):
        stream_s = _median(lambda: stream(batch), repeats)  # noqa: B023 (called here, in this iteration)
        out[order] = {
            "stream_positions_per_s": round(positions / stream_s),
            "slices_per_position": round(pieces[-1] / positions, 4),
        }
    plan = source.plan
    count_s = _median(
        lambda: [
            plan.batch_sources(0, p, p + rank_batch, start, global_batch)
            for p in range(start, start + positions, rank_batch)
        ],
        repeats,
    )
    out["rank_count_positions_per_s"] = round(positions / count_s)
    return out


def batch_assembly(repeats: int, seq: int = 1024, rows: int = 1024) -> Dict[str, Any]:
    import numpy as np
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    from raytrain_events.data.ray.batch_tensors import table_to_torch

    def block(k: int) -> Any:
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4 * rows * seq, dtype=np.int32)), seq)
        return pa.table({"tokens": tokens, "id": np.arange(4 * rows) + k * 100_000}), None

    blocks = {k: block(k) for k in range(3)}
    rng = np.random.default_rng(0)
    pieces, at, n = [], [0, 0, 0], 0
    while n < rows:
        k, c = int(rng.integers(3)), min(int(rng.integers(1, 4)), rows - n)
        pieces.append((k, at[k], at[k] + c))
        at[k], n = at[k] + c, n + c
    grouped = [(k, 0, at[k]) for k in range(3) if at[k]]  # the same rows, listed by source: one slice each

    def assemble(slices: List[Any]) -> Any:  # the loader's path for slices of whole blocks (data/ray/loader.py)
        parts = [BlockAccessor.for_block(blocks[k][0]).slice(lo, hi, copy=False) for k, lo, hi in slices]
        return table_to_torch(parts[0] if len(parts) == 1 else pa.concat_tables(parts))

    assemble(pieces)  # imports
    mixed = _median(lambda: assemble(pieces), repeats)
    by_source = _median(lambda: assemble(grouped), repeats)
    single = _median(lambda: assemble([(0, 0, rows)]), repeats)
    return {
        "plan_order_slices": len(pieces),
        "plan_order_ms": round(mixed * 1e3, 2),
        "run_order_slices": len(grouped),
        "run_order_ms": round(by_source * 1e3, 3),
        "one_slice_ms": round(single * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sources", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="global positions per plan.rows call")
    parser.add_argument("--loader-batch", type=int, default=32)
    args = parser.parse_args()
    out = {
        "resume": resume_cost(args.sources, args.repeats),
        "plan": plan_rows_per_s(args.sources, args.batch, args.repeats),
        "loader": loader_overhead(args.repeats, args.loader_batch),
        "ray_stream": ray_stream(args.repeats),
        "batch_assembly": batch_assembly(args.repeats),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
