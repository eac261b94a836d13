"""A finished run's ``summary.json``: built from the `RayTrainer` result, written, printed.

The run directory's summary is what ``raytrain-events runs ls`` and ``inspect`` read (a run with
one is "finished"): the final global Timestamp, the final metrics, one line per evaluated epoch,
the checkpoints, the wall time and the job's config. Jobs (the digits example) call
`run_summary`, `write_summary` and `format_summary` at the end of a run.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from raytrain_events.storage.fs import resolve, to_url, write_bytes_atomic
from raytrain_events.storage.run_dir import RunDir

__all__ = ["run_summary", "eval_history", "write_summary", "format_summary"]


def run_summary(  # noqa: PLR0913 (the result, then keyword-only: the facts the summary holds)
    result: Any,
    *,
    run_name: str,
    config: Dict[str, Any],
    seconds: float,
    checkpoint_folder: Optional[str],
    storage_options: Optional[Dict[str, Any]] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """The summary of a finished `RayTrainer.fit` result (``extra`` adds job facts like row counts).

    Its per-epoch lines come from the run directory's whole history (every fit of the run: a resumed run
    lists the epochs before the resume too), or from this fit's history where the file cannot be read.
    """
    ts = result.timestamp
    history = result.history
    if result.run_url:
        try:
            history = RunDir(result.run_url, storage_options or {}).read_history() or history
        except Exception:  # noqa: BLE001 -- unreadable storage: this fit's own reports still make a summary
            pass
    return {
        "run_name": run_name,
        "run_url": result.run_url,
        "timestamp": {
            "epoch": ts.epoch.value,
            "batch": ts.batch.value,
            "sample": ts.sample.value,
            "token": ts.token.value,
        },
        "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str, bool)) or v is None},
        "eval_history": eval_history(history),
        "checkpoint_folder": checkpoint_folder,
        "checkpoints": [{"name": c.name, "url": c.url, "timestamp": dict(c.timestamp)} for c in result.checkpoints],
        "wall_seconds": round(seconds, 2),
        "config": config,
        **extra,
    }


def eval_history(entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One line per epoch: the last report of each epoch (eval accuracy, mean train loss since the previous report)."""
    by_epoch: Dict[Any, Dict[str, Any]] = {}
    for e in entries:
        if "metrics/eval/accuracy" in e:
            previous = by_epoch.get(e.get("time/epoch"), {})
            by_epoch[e.get("time/epoch")] = {
                "epoch": e.get("time/epoch"),
                "batch": e.get("time/batch"),
                "sample": e.get("time/sample"),
                "train_loss": e.get("train/loss", previous.get("train_loss")),
                "eval_accuracy": e.get("metrics/eval/accuracy"),
            }
    return list(by_epoch.values())


def write_summary(run_url: str, summary: Dict[str, Any], options: Dict[str, Any]) -> str:
    """Write the run's summary file (`RunDir.summary`) atomically; returns its URL."""
    fs, path = resolve(RunDir(run_url, options).summary, options)
    write_bytes_atomic(fs, path, json.dumps(summary, indent=2, sort_keys=True, default=str).encode())
    return to_url(fs, path)


def format_summary(summary: Dict[str, Any]) -> str:
    """The end-of-run report printed on the driver."""
    ts = summary["timestamp"]
    metrics = summary["metrics"]
    lines = [
        "",
        f"Run {summary['run_name']} finished in {summary['wall_seconds']:.1f}s",
        f"  timestamp:   epoch={ts['epoch']} batch={ts['batch']} sample={ts['sample']} token={ts['token']}",
    ]
    for entry in summary["eval_history"]:
        acc = entry["eval_accuracy"]
        loss = entry["train_loss"]
        lines.append(
            f"  epoch {entry['epoch']:>3} batch {entry['batch']:>5}: eval accuracy {acc:.4f}"
            + (f", train loss {loss:.4f}" if isinstance(loss, float) else "")
        )
    shown = {k: v for k, v in metrics.items() if k.startswith(("train/", "metrics/"))}
    for key in sorted(shown):
        value = shown[key]
        lines.append(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    if summary["checkpoint_folder"]:
        names = (
            ", ".join(f"{c['name']} (batch {c['timestamp'].get('batch')})" for c in summary["checkpoints"])
            or "none saved"
        )
        lines.append(f"  checkpoints: {summary['checkpoint_folder']}: {names}")
    lines.append(f"  summary:     {summary.get('summary_url', summary['run_url'] + '/summary.json')}")
    if summary.get("report_url"):
        lines.append(f"  report:      {summary['report_url']}")
    return "\n".join(lines)
