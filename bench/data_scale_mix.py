"""The mixing arms of ``bench/data_scale.py``: three weighted sources instead of one, on each data path.

The bench's Parquet files are split into three sources (``web``, ``code``, ``math``: consecutive
files, hard links into three folders, as many files each as `MIX_WEIGHTS` 0.5/0.3/0.2 apportion),
and each path mixes them with weights equal to the sources' shares of the rows, so an epoch is
every row once, the same rows as the single-source arms, only interleaved. The arms:

- ``ours-mix``: the feeder path ``RayTrainer(mixture=Mixture(...), datasets={name: ParquetRowGroups(folder)})``
  builds (`mixture_source.check_mixture`, `MixtureRun`, `MixtureSource`, as ``mixture_train_set`` does on
  the driver) in the same plain actors as ``ours-seek``, each rank with `MixtureOrderLoader` (the
  per-source counts of every batch included); its resume is a new feeder and loaders at 50%,
  which enter each source at its cursor.
- ``ray-data-mix``: ``read_parquet(web).mix(read_parquet(code), read_parquet(math), weights=...)``
  (Ray Data 2.60's weighted interleave of blocks) through Ray Train's ``streaming_split`` in a plain
  `TorchTrainer`, as the ``ray-data`` arm. A mixed Dataset has no mid-epoch resume: its "resume"
  cell is a second pass iterating past the first half (marked in the table).
- ``streaming-mix``: MosaicML Streaming's ``StreamingDataset(streams=[Stream(proportion=w), ...])``
  over the three sources' MDS shards (``data_scale_arms.streaming_arm`` with ``mix``), in rank actors as the ``streaming`` arm; resumed by
  ``load_state_dict`` at 50%.

`mixing_costs` is the ratio of each mixing arm to its single-source arm (ours-mix / ours-seek,
ray-data-mix / ray-data, streaming-mix / streaming), repeat by repeat (the arms of one repeat ran
back to back on the same cluster), given as the median [min-max]: the cost of mixing (goal: rows/s
within 5% of a single source, a ratio >= 0.95).
"""

from __future__ import annotations

import glob
import os
import statistics
from fractions import Fraction
from typing import Any, Dict, List, Optional

MIX_NAMES = ("web", "code", "math")
MIX_WEIGHTS = (0.5, 0.3, 0.2)
MIX_ARMS = {"ours-mix": "ours-seek", "ray-data-mix": "ray-data", "streaming-mix": "streaming"}


def split_sources(data: str, out: str) -> Dict[str, Dict[str, Any]]:
    """The Parquet files of ``data`` as three source folders under ``out``: ``{name: {"folder", "rows", "weight"}}``.

    Consecutive files (hard links), as many per source as `MIX_WEIGHTS` apportion (at least one
    each); ``weight`` is the source's share of the rows, so a mixture over them trains every row once.
    """
    import pyarrow.parquet as pq

    from raytrain_events.core.mixture_plan import apportion

    files = sorted(glob.glob(os.path.join(data, "*.parquet")))
    if len(files) < len(MIX_NAMES):
        raise ValueError(f"The mixing arms need at least {len(MIX_NAMES)} Parquet files (--files); got {len(files)}.")
    counts = apportion(len(files) - len(MIX_NAMES), [Fraction(w).limit_denominator() for w in MIX_WEIGHTS])
    sources: Dict[str, Dict[str, Any]] = {}
    start = 0
    for name, count in zip(MIX_NAMES, counts, strict=True):
        folder = os.path.join(out, name)
        os.makedirs(folder)
        part = files[start : start + count + 1]
        start += count + 1
        for path in part:
            os.link(path, os.path.join(folder, os.path.basename(path)))
        sources[name] = {"folder": folder, "rows": sum(pq.ParquetFile(p).metadata.num_rows for p in part)}
    total = sum(s["rows"] for s in sources.values())
    for source in sources.values():
        source["weight"] = source["rows"] / total
    return sources


def ours_mix_source(sources: Dict[str, Dict[str, Any]], global_batch: int) -> Any:
    """The `MixtureSource` ``RayTrainer(mixture=..., datasets={name: ParquetRowGroups(folder)})`` streams
    for one epoch (what ``mixture_train_set`` builds on the driver, without a `RunSpec`)."""
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.core.mixture_plan import MixtureRun
    from raytrain_events.data.ray.mixture_source import MixtureSource, check_mixture
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    mixture = Mixture(
        sources={n: s["rows"] for n, s in sources.items()}, weights={n: s["weight"] for n, s in sources.items()}
    )
    datasets = {name: ParquetRowGroups(source["folder"]) for name, source in sources.items()}
    checked = check_mixture(mixture.to_dict(), datasets, None)
    rows = sum(s["rows"] for s in sources.values())  # the epoch: every source's rows (no epoch_size given)
    run = MixtureRun(mixture, 0, rows, global_batch)
    run.plan()
    return MixtureSource(checked, run, None)


def ray_data_mix(ray: Any, sources: Dict[str, Dict[str, Any]]) -> Any:
    """``Dataset.mix`` of the three sources' ``read_parquet`` with their weights (every row once)."""
    reads = [ray.data.read_parquet(s["folder"]) for s in sources.values()]
    return reads[0].mix(*reads[1:], weights=[s["weight"] for s in sources.values()])


def mixing_costs(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """``{mixing arm: {measure: (median, min, max) of mix / single, repeat by repeat}}`` for the arms both ran."""
    keys = (
        "rows_per_s_per_worker",
        "epoch_rows_per_s_per_worker",
        "first_batch_s",
        "resume_first_batch_s",
        "peak_store_bytes",
    )
    out: Dict[str, Dict[str, Any]] = {}
    for mix, single in MIX_ARMS.items():
        pairs = list(zip(runs.get(mix, []), runs.get(single, [])))
        pairs = [(m, s) for m, s in pairs if "error" not in m and "error" not in s]
        if not pairs:
            continue
        ratios: Dict[str, Any] = {"vs": single, "repeats": len(pairs)}
        for key in keys:
            values = [m[key] / s[key] for m, s in pairs if m.get(key) is not None and s.get(key)]
            if values:
                ratios[key] = (statistics.median(values), min(values), max(values))
        out[mix] = ratios
    return out


def costs_table(costs: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """The mixing costs as a Markdown table (None when no mixing arm ran beside its single-source arm)."""
    if not costs:
        return None

    def cell(ratio: Any) -> str:
        if ratio is None:
            return "-"
        median, low, high = ratio
        return f"{median:.2f}x" + (f" [{low:.2f}-{high:.2f}]" if low != high else "")

    lines = [
        "| mixing arm / single source | rows/s per worker, first to last batch | rows/s per worker, whole epoch "
        "| first batch | resume at 50%: first batch | peak object store |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mix, ratios in costs.items():
        lines.append(
            f"| {mix} / {ratios['vs']} | {cell(ratios.get('rows_per_s_per_worker'))} "
            f"| {cell(ratios.get('epoch_rows_per_s_per_worker'))} | {cell(ratios.get('first_batch_s'))} "
            f"| {cell(ratios.get('resume_first_batch_s'))} | {cell(ratios.get('peak_store_bytes'))} |"
        )
    return "\n".join(lines)
