"""`SweepResult`: the table of a sweep's trials, the best algorithm set and its best checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.checkpoint.folder.store import latest_checkpoint
from raytrain_events.core.plain import flatten, is_finite_number, to_plain
from raytrain_events.core.time import COUNTER_UNITS, report_key, training_duration
from raytrain_events.ray.checkpointing.validation import in_training_order, is_validation_entry, training_entries

# The file a finished trial writes into its Tune trial folder (its history, checkpoints, run URL): defined with
# the other directory names (storage/run_dir.py), re-exported here.
from raytrain_events.storage.fs import basename, join, read_bytes, resolve
from raytrain_events.storage.run_dir import TRIAL_RECORD as TRIAL_RECORD
from raytrain_events.storage.run_dir import RunDir
from raytrain_events.tune.sets import algorithm_set_label, normalize_set

logger = logging.getLogger(__name__)

#: Global Timestamp keys in every reported entry; any of them can be a scheduler's ``time_attr``.
TIME_ATTRS = tuple(report_key(name) for name in COUNTER_UNITS)
#: The Train run name of every trial (the run folder inside the trial folder).
TRIAL_RUN_NAME = "train"
#: Per-source counts a mixture run reports (`MixtureCounts`): the table shows tokens, else samples.
MIXTURE_COUNT_PREFIXES = ("mixture/tokens/", "mixture/samples/")
#: File in a trial folder listing the trials it copied (PBT exploits): when, which checkpoint, which set.
LINEAGE_FILE = "raytrain_lineage.json"


def _history_of(result: Any) -> List[Dict[str, Any]]:
    """The entries Tune received for one trial (from its result.json), NaN-free."""
    frame = None
    try:
        frame = result.metrics_dataframe
    except Exception:  # no result files (trial never reported)
        frame = None
    if frame is None or len(frame) == 0:
        return [dict(result.metrics)] if result.metrics else []
    entries = []
    for row in frame.to_dict("records"):
        row = to_plain(row, fallback=lambda value: value)  # numpy scalars from the frame as Python values
        entries.append({k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})
    return entries


@dataclass
class SweepResult:
    """The outcome of `sweep`: one row per trial, best first, and the best algorithm set.

    ``rows`` are dicts with ``trial_id``, ``algorithms`` (the set's label),
    ``algorithm_specs`` (the set as given), the trial's other ``params`` (flattened, also as
    top-level keys), the metric (its last reported value), ``time/epoch|batch|sample|token`` and
    ``world_size`` of the last result Tune got, ``status`` (``"completed"``: reached
    ``max_duration``; ``"stopped"``: stopped early by the scheduler; ``"error"``), ``error``,
    ``checkpoint`` (the trial's best checkpoint path or None), ``run_url`` (its Train run folder,
    the newest one), ``path`` (its Tune trial folder), ``lineage`` (PBT: each trial it copied, as
    ``{"copied_trial", "checkpoint", "counters", "from_algorithms", "algorithms", "run_name"}``,
    oldest first) and ``copied`` (the lineage in short, ``trial_x@384sp``, or None). A mixture
    sweep's rows also hold the trial's weights (``mixture/<source>``, from its config) and its
    per-source counts at its last result (``mixture/tokens/<source>``, ``mixture/samples/<source>``),
    and the table shows them.
    """

    metric: str
    mode: str
    rows: List[Dict[str, Any]]
    path: str
    result_grid: Any = None
    histories: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    time_attr: str = "time/sample"

    @property
    def best(self) -> Optional[Dict[str, Any]]:
        """The best trial's row: the best last value of the metric among trials that did not fail."""
        if not self.rows or self.rows[0].get(self.metric) is None or self.rows[0]["status"] == "error":
            return None
        return self.rows[0]

    @property
    def best_algorithms(self) -> Optional[List[Any]]:
        """The best trial's algorithm set (a list of specs)."""
        return None if self.best is None else self.best["algorithm_specs"]

    @property
    def best_label(self) -> Optional[str]:
        return None if self.best is None else self.best["algorithms"]

    @property
    def best_config(self) -> Optional[Dict[str, Any]]:
        """The best trial's full config (as Tune sampled it)."""
        return None if self.best is None else self.best["config"]

    @property
    def best_checkpoint(self) -> Optional[str]:
        """Path/URL of the best trial's best checkpoint (None if it saved none)."""
        return None if self.best is None else self.best["checkpoint"]

    @property
    def errors(self) -> List[Dict[str, Any]]:
        return [row for row in self.rows if row["status"] == "error"]

    def to_table(self) -> str:
        """A plain-text table of the trials, best first (``*`` marks the best)."""
        params = sorted({k for row in self.rows for k in row["params"]})
        times = [self.time_attr] if self.time_attr in TIME_ATTRS else []
        times += [t for t in ("time/sample",) if t not in times]
        copied = any(row.get("copied") for row in self.rows)
        counts = _count_columns(self.rows)
        header = ["", "trial", "status", "algorithms", *params, self.metric, *times, *counts]
        header += ["copied"] if copied else []
        best = self.best
        lines = []
        for row in self.rows:
            cells = ["*" if best is not None and row is best else "", row["trial_id"], row["status"], row["algorithms"]]
            cells += [_fmt(row["params"].get(p)) for p in params]
            cells += [_fmt(row.get(self.metric))] + [_fmt(row.get(t)) for t in times]
            cells += [_fmt(row.get(c)) for c in counts]
            cells += [_fmt(row.get("copied"))] if copied else []
            lines.append(cells)
        widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
        out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_table()


def _count_columns(rows: List[Dict[str, Any]]) -> List[str]:
    """The per-source count columns of a mixture sweep: tokens per source, else samples per source."""
    for prefix in MIXTURE_COUNT_PREFIXES:
        found = sorted({k for row in rows for k in row if k.startswith(prefix)})
        if found:
            return found
    return []


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _better(a: float, b: float, mode: str) -> bool:
    return a > b if mode == "max" else a < b


def _best_checkpoint(
    history: List[Dict[str, Any]], metric: str, mode: str, run_url: str, storage_options: Dict[str, Any]
) -> Optional[str]:
    """The reported checkpoint with the best metric (else the newest), or the newest saved one."""

    best: Optional[Tuple[float, str]] = None
    newest: Optional[str] = None
    paths: Dict[str, str] = {}  # an async validation names its checkpoint; its training entry has the path
    for entry in in_training_order(history):
        if is_validation_entry(entry):
            path = paths.get(str(entry.get("validated_checkpoint")))
        else:
            path = entry.get("checkpoint_path")
            if path:
                newest = paths[basename(path)] = path
        if not path:
            continue
        value = entry.get(metric)
        if is_finite_number(value) and (best is None or _better(value, best[0], mode) or value == best[0]):
            best = (value, path)
    if best is not None:
        return best[1]
    if newest is not None:
        return newest
    try:
        info = latest_checkpoint(RunDir(run_url).checkpoints, storage_options=storage_options)
    except Exception:  # no checkpoints, or checkpointing not available
        return None
    return None if info is None else info.url


def read_lineage(trial_url: str, storage_options: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The trial's PBT copies (`LINEAGE_FILE`), oldest first: which trial it copied, at which counters,
    which set it took ([] if it never copied one, or if the file is unreadable)."""
    fs, path = resolve(join(trial_url, LINEAGE_FILE), storage_options)
    try:
        return list(json.loads(read_bytes(fs, path)))
    except FileNotFoundError:
        return []
    except ValueError:  # a torn or foreign file
        logger.warning("Ignoring unreadable lineage file %s.", join(trial_url, LINEAGE_FILE))
        return []


def make_result(
    result_grid: Any,
    *,
    metric: str,
    mode: str,
    spec: Any,
    experiment_url: str,
    storage_options: Dict[str, Any],
    time_attr: str,
    max_t: Any = None,
) -> SweepResult:
    """The sweep's `SweepResult`: one row per trial (`trial_row`), the best first (`_rank`)."""
    rows: List[Dict[str, Any]] = []
    histories: Dict[str, List[Dict[str, Any]]] = {}
    for result in result_grid:
        history = _history_of(result)
        row = trial_row(
            result,
            history,
            metric=metric,
            mode=mode,
            spec=spec,
            experiment_url=experiment_url,
            storage_options=storage_options,
            time_attr=time_attr,
            max_t=max_t,
        )
        histories[row["trial_id"]] = history
        rows.append(row)
    rows.sort(key=lambda row: _rank(row, metric, mode))
    return SweepResult(
        metric=metric,
        mode=mode,
        rows=rows,
        path=experiment_url,
        result_grid=result_grid,
        histories=histories,
        time_attr=time_attr,
    )


def trial_row(  # noqa: PLR0913 (the sweep's settings, as make_result has them)
    result: Any,
    history: List[Dict[str, Any]],
    *,
    metric: str,
    mode: str,
    spec: Any,
    experiment_url: str,
    storage_options: Dict[str, Any],
    time_attr: str,
    max_t: Any,
) -> Dict[str, Any]:
    """One trial's row of the results table, from its Ray Tune ``result`` and its ``history``."""
    config = dict(result.config or {})
    trained = training_entries(history)  # async validations arrive late, at earlier Timestamps
    last = trained[-1] if trained else dict(result.metrics or {})
    trial_id = last.get("trial_id") or (result.metrics or {}).get("trial_id") or os.path.basename(result.path)
    values = [e[metric] for e in in_training_order(history) if is_finite_number(e.get(metric))]
    specs = normalize_set(config["algorithms"]) if "algorithms" in config else normalize_set(spec.algorithms)
    params = flatten({k: v for k, v in config.items() if k != "algorithms"}, sep="/")
    overrides = config.get("trainer") or {}
    # The trial's length by the loop's own rule (`LoopOptions` checks max_duration with the same function).
    duration = training_duration(overrides["max_duration"]) if "max_duration" in overrides else spec.max_duration
    trial_url = join(experiment_url, os.path.basename(result.path.rstrip("/")))
    lineage = read_lineage(trial_url, storage_options)
    run_url = join(trial_url, lineage[-1]["run_name"] if lineage else TRIAL_RUN_NAME)
    return {
        "trial_id": trial_id,
        "algorithms": algorithm_set_label(specs),
        "algorithm_specs": specs,
        **params,
        "params": params,
        "config": config,
        metric: values[-1] if values else None,
        **{t: last.get(t) for t in TIME_ATTRS},
        "world_size": last.get("world_size"),
        "status": _status(result, history, last, duration, time_attr, max_t),
        "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}",
        "checkpoint": _best_checkpoint(history, metric, mode, run_url, storage_options),
        "run_url": run_url,
        "path": result.path,
        "lineage": lineage,
        "copied": "; ".join(f"{s['copied_trial']}@{s['counters'].get('sample')}sp" for s in lineage) or None,
        # A mixture run's per-source counts at its last result (MixtureCounts): sum to its samples / tokens.
        **{k: v for k, v in last.items() if k.startswith(MIXTURE_COUNT_PREFIXES)},
    }


def _status(result: Any, history: List[Any], last: Dict[str, Any], duration: Any, time_attr: str, max_t: Any) -> str:
    """A trial's status: error, completed (its ``duration``, or a scheduler's budget ``max_t`` in ``time_attr``),
    stopped (early, by the scheduler) or no results."""
    done_key = report_key(duration.unit)  # the trainer refuses durations in other units
    reached = is_finite_number(last.get(done_key)) and last[done_key] >= duration.value
    # A scheduler stops a trial at its budget (ASHA's max_t with stop_last_trials), maybe one
    # report before the trainer's own end: that trial completed too.
    budget = is_finite_number(max_t) and is_finite_number(last.get(time_attr)) and last[time_attr] >= max_t
    if result.error is not None:
        return "error"
    if last.get("final") or reached or budget:
        return "completed"
    return "stopped" if history else "no results"


def _rank(row: Dict[str, Any], metric: str, mode: str) -> Tuple[int, float, str]:
    """A row's sort key: best first; trials that failed rank after all that did not, those without a value last."""
    value = row[metric]
    if value is None:
        return (2, 0.0, row["trial_id"])
    return (1 if row["status"] == "error" else 0, -value if mode == "max" else value, row["trial_id"])
