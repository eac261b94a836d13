"""Run reports: ``report.html`` plus PNGs in a run (or sweep) directory, from what the run saved.

``raytrain-events report RUN_DIR`` (and the end of ``examples/train.py``) call `write_report`:

* a **run directory** (``config.yaml`` and ``history.jsonl`` written by `RayTrainer`): train
  loss and every eval metric against global samples (and tokens when counted), the learning
  rate, throughput with checkpoints and restarts marked on the time axis, goodput with each
  restart's cause and time lost (`raytrain_events.report.goodput`), the checkpoints, the
  checkpoint saves that failed for good (from ``checkpoints/index.json``) and the run config;
  a run directory with only checkpoints (a local `Trainer` run) gets the checkpoint sections;
  a run whose mixture adapts during the run (``online=``) gets its weights over time, from the newest
  checkpoint (``mixture_weights.py``);
* a **sweep directory** (trial folders with ``raytrain_trial.json``, written by
  `raytrain_events.tune.sweep`): one figure comparing the algorithm sets (the metric against
  global samples, a line per trial, the best thick), the results table sorted by the metric, and
  under population-based training each trial's lineage (which trial it copied, at which global
  sample, which algorithm set it switched to; from the trial records).

The HTML is static (inline CSS, no scripts); the PNGs sit next to it. Any fsspec URL works.

Files:

* ``goodput.py``: Goodput of a run: the share of wall time spent on batches that count, and what
  each restart cost.
* ``history_file.py``: The run's history file, re-exported: its name and format belong to the run
  directory's owner (``storage/run_dir.py``), so the runtime (``ray/driver.py`` writes it) never
  imports this package.
* ``html.py``: Static, self-contained HTML for the run report: inline CSS, no scripts, PNGs next to
  it.
* ``mixture_weights.py``: The run report's mixture weights over time: the weights history an online
  policy saved in the newest checkpoint.
* ``plots.py``: The run report's figures (matplotlib, headless Agg), each returned as PNG bytes of
  a fixed size.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.core.plain import is_finite_number
from raytrain_events.core.time import COUNTER_UNITS, report_key
from raytrain_events.report import html
from raytrain_events.report.goodput import goodput, goodput_figure, goodput_section, read_events, read_failures
from raytrain_events.report.mixture_weights import weights_sections
from raytrain_events.report.plots import run_figures, sweep_figure
from raytrain_events.storage.fs import join, read_bytes, resolve, to_url, write_bytes_atomic
from raytrain_events.storage.run_dir import (
    CONFIG_FILE,
    HISTORY_FILE,
    REPORT_FILE,
    SWEEP_FILE,
    TRIAL_RECORD,
    RunDir,
    append_history,
    read_history,
)

__all__ = ["write_report", "append_history", "read_history", "HISTORY_FILE", "REPORT_FILE", "SWEEP_FILE"]


def write_report(
    url: str,
    storage_options: Optional[Dict[str, Any]] = None,
    *,
    metric: Optional[str] = None,
    mode: Optional[str] = None,
) -> Dict[str, Any]:
    """Write ``report.html`` and its PNGs into the run or sweep directory ``url``.

    Returns ``{"html": <url of report.html>, "images": [<png urls>], "kind": "run" | "sweep"}``.
    Raises FileNotFoundError (naming what is missing) if ``url`` is neither.
    """
    options = dict(storage_options or {})
    fs, root = resolve(url, options)
    fs.invalidate_cache(root)  # the run was written by other processes or threads: read the store as it is now
    if not fs.exists(root):
        raise FileNotFoundError(f"{url} does not exist: pass a run directory (<storage>/<run_name>) or a sweep's.")
    trials = _trial_records(fs, root)
    if trials:
        kind, title, sections, files = "sweep", *_sweep_report(url, options, trials, metric, mode)
    elif any(fs.exists(resolve(location, options)[1]) for location in _run_files(RunDir(url, options))):
        kind, title, sections, files = "run", *_run_report(url, options)
    else:
        raise FileNotFoundError(
            f"{url} has no {HISTORY_FILE} or {CONFIG_FILE} (a RayTrainer run directory) and no trial folders with "
            f"{TRIAL_RECORD} (a sweep): pass the folder a run or sweep wrote."
        )
    images = [_write(url, options, name, data) for name, data in files.items()]
    page = html.page(title, sections, note=f"Written by raytrain-events report from {url}")
    return {"html": _write(url, options, REPORT_FILE, page.encode("utf-8")), "images": images, "kind": kind}


def _run_files(run: RunDir) -> Tuple[str, ...]:
    """What marks a run directory: its history, its config, or a checkpoint index (a local run)."""
    return (run.history, run.config, run.checkpoint_index)


def _write(url: str, options: Dict[str, Any], name: str, data: bytes) -> str:
    fs, path = resolve(join(url, name), options)
    write_bytes_atomic(fs, path, data)
    return to_url(fs, path)


# ------------------------------------------------------------------------------------ a run
def _run_report(url: str, options: Dict[str, Any]) -> Tuple[str, List[str], Dict[str, bytes]]:
    history = read_history(url, options)
    config = _load_config(url, options)
    figures = run_figures(history)
    files = {f"{name}.png": png for name, png in figures.items()}
    final = history[-1] if history else {}
    name = (config or {}).get("run_name") or url.rstrip("/").rsplit("/", 1)[-1]
    sections = ["<h2>Summary</h2>"]
    rows = [[k, final[k]] for k in map(report_key, COUNTER_UNITS) if k in final]
    rows += [[k, final[k]] for k in sorted(final) if k.startswith(("train/", "metrics/", "spikes/"))]
    rows.append(["reports", len(history)])
    rows.append(["attempts (worker group starts)", len({e.get("attempt") for e in history})])
    sections.append(html.table(["", "final value"], rows) if history else "<p>No reports saved yet.</p>")
    captions = {
        "metrics.png": "Train loss and eval metrics against global samples (dashed red: a restart; dash-dot purple "
        "on the loss: a spike rolled back)",
        "metrics_tokens.png": "The same against global tokens",
        "learning_rate.png": "Learning rate",
        "throughput.png": "Throughput; checkpoints (dotted green) and restarts (dashed red) on the time axis",
    }
    for file in files:
        sections += [f"<h2>{html.escape(captions.get(file, file))}</h2>", html.image(file, captions.get(file, file))]
    sections += _per_source_section(final)
    weights, weights_png = weights_sections(url, options, final.get("time/sample"))
    sections += weights
    files.update(weights_png)
    sections += _goodput_sections(url, options, history, files)
    checkpoints, deleted = _kept_checkpoints(url, options, [e for e in history if e.get("checkpoint_path")])
    if checkpoints:
        start = next((e["wall_time"] for e in history if "wall_time" in e), None)
        sections.append("<h2>Checkpoints</h2>")
        if deleted:
            sections.append(
                f"<p>The checkpoints in the run directory now; {deleted} older one(s) were deleted (keep).</p>"
            )
        sections.append(
            html.table(
                ["checkpoint", "epoch", "batch", "sample", "minute", "attempt"],
                [
                    [
                        c["checkpoint_path"].rstrip("/").rsplit("/", 1)[-1],
                        c.get("time/epoch"),
                        c.get("time/batch"),
                        c.get("time/sample"),
                        None if start is None or "wall_time" not in c else round((c["wall_time"] - start) / 60, 2),
                        c.get("attempt"),
                    ]
                    for c in checkpoints
                ],
            )
        )
    sections += _failed_saves_section(url, options)
    if config is not None:
        import yaml

        sections += ["<h2>Run config</h2>", html.pre(yaml.safe_dump(config, sort_keys=False, default_flow_style=False))]
    return f"Run report: {name}", sections, files


def _kept_checkpoints(
    url: str, options: Dict[str, Any], saved: List[Dict[str, Any]]
) -> Tuple[List[Dict[str, Any]], int]:
    """The history's checkpoint entries whose checkpoint is still in the run's checkpoints folder, and how many
    were deleted (``keep``); all of them when the folder cannot be listed. One listing of the folder."""
    from raytrain_events.checkpoint.folder.store import list_checkpoints  # why here: imports torch

    folder = RunDir(url, options).checkpoints
    try:
        fs, path = resolve(folder, options)
        if not fs.exists(path):
            return saved, 0  # checkpoints kept elsewhere (a moved run): the history is all there is
        names = {c.name for c in list_checkpoints(folder, storage_options=options)}
    except Exception:  # noqa: BLE001 -- an unreadable folder: the report shows what the history lists
        return saved, 0
    kept = [e for e in saved if e["checkpoint_path"].rstrip("/").rsplit("/", 1)[-1] in names]
    return kept, len(saved) - len(kept)


def _per_source_section(final: Dict[str, Any]) -> List[str]:
    """Tokens seen per source of a `Mixture` (``mixture/samples/<source>``, ``mixture/tokens/<source>``)."""
    names = sorted({k.split("/", 2)[2] for k in final if k.startswith(("mixture/samples/", "mixture/tokens/"))})
    if not names:
        return []
    # Whole counts (a Ray run's history holds them as the ranks' mean of one value: a float).
    tokens = {n: int(final.get(f"mixture/tokens/{n}") or 0) for n in names}
    samples = {n: int(final.get(f"mixture/samples/{n}") or 0) for n in names}
    all_tokens, all_samples = sum(tokens.values()), sum(samples.values())
    rows = [
        [
            n,
            samples[n],
            round(samples[n] / all_samples, 4) if all_samples else None,
            tokens[n],
            round(tokens[n] / all_tokens, 4) if all_tokens else None,
        ]
        for n in names
    ]
    return ["<h2>Tokens seen per source</h2>", html.table(["source", "samples", "share", "tokens", "share"], rows)]


def _failed_saves_section(url: str, options: Dict[str, Any]) -> List[str]:
    """The saves that failed for good (training went on; the previous checkpoint stayed "latest")."""
    fs, path = resolve(RunDir(url, options).checkpoint_index, options)
    try:
        failed = json.loads(read_bytes(fs, path)).get("failed") or []
    except (FileNotFoundError, ValueError, AttributeError):
        return []
    if not failed:
        return []
    rows = [[f.get("name"), f.get("batch"), _utc(f.get("time")), f.get("error")] for f in failed]
    return [
        "<h2>Failed checkpoint saves</h2>",
        f"<p>{len(failed)} save(s) failed for good after retrying until the upload deadline; training went on "
        "and the previous committed checkpoint stayed the one to resume from.</p>",
        html.table(["checkpoint", "batch", "failed at (UTC)", "error"], rows),
    ]


def _utc(seconds: Any) -> Optional[str]:
    if not is_finite_number(seconds):
        return None
    return datetime.datetime.fromtimestamp(float(seconds), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _goodput_sections(url: str, options: Dict[str, Any], history: List[Dict[str, Any]], files: Dict[str, bytes]):
    """Goodput, and each restart with its cause and time lost (`raytrain_events.report.goodput`)."""
    summary = goodput(history, *read_events(url, options), read_failures(url, options))
    sections = goodput_section(summary)
    figure = goodput_figure(summary) if summary["restarts"] else None
    if figure is not None:
        files["goodput.png"] = figure
        sections.append(html.image("goodput.png", "Worker groups on the time axis: counted (green), lost (red)"))
    return sections


def _load_config(url: str, options: Dict[str, Any]) -> Optional[Dict[str, Any]]:

    try:
        config = RunDir(url, options).load_config()
    except FileNotFoundError:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config) if OmegaConf.is_config(config) else dict(config)


# ---------------------------------------------------------------------------------- a sweep
def _trial_records(fs: Any, root: str) -> Dict[str, Dict[str, Any]]:
    """Trial folder name -> its record, for every trial folder under ``root`` that has one."""
    records = {}
    for path in sorted(fs.glob(root.rstrip("/") + "/*/" + TRIAL_RECORD)):
        folder = path.rstrip("/").rsplit("/", 2)[-2]
        with fs.open(path, "rb") as fh:
            records[folder] = json.loads(fh.read().decode("utf-8"))
    return records


def _sweep_report(
    url: str,
    options: Dict[str, Any],
    trials: Dict[str, Dict[str, Any]],
    metric: Optional[str],
    mode: Optional[str],
) -> Tuple[str, List[str], Dict[str, bytes]]:
    saved = _sweep_settings(url, options)
    metric = metric or saved.get("metric") or _first_metric(trials)
    mode = mode or saved.get("mode") or ("min" if "loss" in (metric or "") else "max")
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'.")
    rows = []
    for folder, record in trials.items():
        history = record.get("history", [])
        values = [e[metric] for e in history if is_finite_number(e.get(metric))]
        last = history[-1] if history else {}
        rows.append(
            {
                "trial": folder,
                "algorithms": _label(record.get("config", {})),
                "value": values[-1] if values else None,
                "best value": (max(values) if mode == "max" else min(values)) if values else None,
                "sample": last.get("time/sample"),
                "reports": len(history),
                "checkpoints": len(record.get("checkpoints", [])),
            }
        )
    sign = -1 if mode == "max" else 1
    rows.sort(key=lambda r: (r["value"] is None, sign * (r["value"] or 0.0)))
    best = rows[0]["trial"] if rows and rows[0]["value"] is not None else None
    files = {}
    figure = sweep_figure(
        {f: r.get("history", []) for f, r in trials.items()},
        {r["trial"]: r["algorithms"] for r in rows},
        metric,
        best,
    )
    sections = [f"<p>Metric <b>{html.escape(metric or '?')}</b> ({mode}); {len(rows)} trials.</p>"]
    if figure is not None:
        files["sweep.png"] = figure
        sections += ["<h2>Algorithm sets compared</h2>", html.image("sweep.png", f"{metric} by algorithm set")]
    header = [
        "trial",
        "algorithms",
        f"{metric} (last)",
        f"{metric} ({mode})",
        "global samples",
        "reports",
        "checkpoints",
    ]
    sections += [
        "<h2>Results, best first</h2>",
        html.table(header, [list(r.values()) for r in rows], highlight=[r["trial"] == best for r in rows]),
    ]
    sections += _lineage_section(trials)
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return f"Sweep report: {name}", sections, files


def _lineage_section(trials: Dict[str, Dict[str, Any]]) -> List[str]:
    """PBT's copies, oldest first per trial: who copied whom, at which global counters, which set it took."""
    rows = [
        [
            folder,
            step.get("copied_trial"),
            (step.get("counters") or {}).get("sample"),
            (step.get("counters") or {}).get("batch"),
            _label({"algorithms": step.get("from_algorithms", [])}),
            _label({"algorithms": step.get("algorithms", [])}),
            step.get("run_name"),
        ]
        for folder, record in trials.items()
        for step in record.get("lineage") or []
    ]
    if not rows:
        return []
    header = ["trial", "copied trial", "at global sample", "at batch", "donor's set", "set after the copy", "new run"]
    return [
        "<h2>Lineage (population-based training)</h2>",
        "<p>Each row is one copy: the trial loaded the copied trial's checkpoint (weights, optimizer state, "
        "exact global Timestamp) into a new run in its folder and went on with its perturbed config.</p>",
        html.table(header, rows),
    ]


def _sweep_settings(url: str, options: Dict[str, Any]) -> Dict[str, Any]:
    fs, path = resolve(join(url, SWEEP_FILE), options)
    if not fs.exists(path):
        return {}
    with fs.open(path, "rb") as fh:
        return json.loads(fh.read().decode("utf-8"))


def _first_metric(trials: Dict[str, Dict[str, Any]]) -> Optional[str]:
    keys = sorted({k for r in trials.values() for e in r.get("history", []) for k in e if k.startswith("metrics/")})
    preferred = [k for k in keys if k.endswith("accuracy")] or keys or ["train/loss"]
    return preferred[0]


def _label(config: Dict[str, Any]) -> str:
    algorithms = config.get("algorithms")
    if algorithms is None:
        return "-"
    from raytrain_events.tune.sets import algorithm_set_label  # why here: tune/ imports ray

    return algorithm_set_label(algorithms)
