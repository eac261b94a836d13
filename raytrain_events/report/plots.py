"""The run report's figures (matplotlib, headless Agg), each returned as PNG bytes of a fixed size.

Every figure is ``WIDTH_PX`` wide; a grid of panels is ``PANEL_HEIGHT_PX`` high per row, so a
figure's size follows from what it shows (tests and HTML rely on it).

* ``metrics``: train loss and every eval metric against global samples; restarts (a new attempt
  of the worker group) are dashed vertical lines; on the train loss, each `SpikeGuard` rollback (a
  spike rolled back) is a purple dash-dot line at the spike's global sample, and the title says the
  rollbacks, the rows skipped and the rows quarantined (`spike_marks`, `spike_summary`).
* ``metrics_tokens``: the same against global tokens (only when tokens were counted).
* ``learning_rate``: the learning rate against global samples.
* ``throughput``: samples per second against wall-clock minutes, checkpoints (dotted, green) and
  restarts (dashed, red) marked on that time axis.
* ``sweep``: a sweep's metric against global samples, one line per trial, the best trial thick.
"""

from __future__ import annotations

import io
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "WIDTH_PX",
    "PANEL_HEIGHT_PX",
    "DPI",
    "SWEEP_SIZE",
    "run_figures",
    "spike_marks",
    "spike_summary",
    "sweep_figure",
    "grid_size",
]

DPI = 100
WIDTH_PX = 1000
PANEL_HEIGHT_PX = 300
_COLUMNS = 2
SWEEP_SIZE = (WIDTH_PX, 2 * PANEL_HEIGHT_PX)  # the sweep comparison: one wide panel


def pyplot_module():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: no display on a cluster node or in CI
    import matplotlib.pyplot as plt

    return plt


def grid_size(panels: int) -> Tuple[int, int]:
    """(width, height) in pixels of a figure with ``panels`` panels."""
    return WIDTH_PX, _rows(panels) * PANEL_HEIGHT_PX


def _columns(panels: int) -> int:
    return 1 if panels <= 1 else _COLUMNS


def _rows(panels: int) -> int:
    return max(1, math.ceil(panels / _columns(panels)))


def save_png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)  # no bbox_inches="tight": the size stays fixed
    pyplot_module().close(fig)
    return buf.getvalue()


def _grid(panels: int):
    plt = pyplot_module()
    width, height = grid_size(panels)
    fig, axes = plt.subplots(
        _rows(panels), _columns(panels), figsize=(width / DPI, height / DPI), dpi=DPI, squeeze=False
    )
    flat = list(axes.flat)
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def _series(history: Sequence[Dict[str, Any]], x_key: str, y_key: str) -> Tuple[List[float], List[float]]:
    xs, ys = [], []
    for entry in history:
        value = entry.get(y_key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(entry.get(x_key, 0))
            ys.append(value)
    return xs, ys


def restarts(history: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The first entry of every attempt after the first (a worker group restarted, or a resume)."""
    out, previous = [], None
    for entry in history:
        attempt = entry.get("attempt")
        if previous is not None and attempt != previous:
            out.append(entry)
        previous = attempt
    return out


def spike_marks(history: Sequence[Dict[str, Any]], x_key: str = "time/sample") -> List[float]:
    """Where the loss spikes were rolled back: the x of each report whose ``spikes/rollbacks`` grew (against
    global samples: the spike's own sample, ``spikes/last_sample``; one mark for several between reports)."""
    out: List[float] = []
    seen = 0.0
    for entry in history:
        count = entry.get("spikes/rollbacks")
        if isinstance(count, (int, float)) and count > seen:
            exact = entry.get("spikes/last_sample") if x_key == "time/sample" else None
            out.append(exact if isinstance(exact, (int, float)) else entry.get(x_key, 0))
            seen = count
    return out


def spike_summary(history: Sequence[Dict[str, Any]]) -> str:
    """``"2 rollbacks, 48 rows skipped, 2 quarantined"`` from the last report that has them, or ``""``."""
    last = next((e for e in reversed(history) if "spikes/rollbacks" in e or "spikes/quarantined_rows" in e), None)
    if last is None:
        return ""
    rollbacks, skipped = int(last.get("spikes/rollbacks", 0)), int(last.get("spikes/skipped_samples", 0))
    return f"{rollbacks} rollbacks, {skipped} rows skipped, {int(last.get('spikes/quarantined_rows', 0))} quarantined"


def metric_keys(history: Sequence[Dict[str, Any]]) -> List[str]:
    """``train/loss`` (if logged) then every eval metric, in name order."""
    keys = {k for e in history for k, v in e.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    evals = sorted(k for k in keys if k.startswith("metrics/"))
    return (["train/loss"] if "train/loss" in keys else []) + evals


def _metrics_figure(history: Sequence[Dict[str, Any]], x_key: str, x_label: str) -> Optional[bytes]:
    keys = metric_keys(history)
    if not keys:
        return None
    fig, axes = _grid(len(keys))
    for ax, key in zip(axes, keys):
        xs, ys = _series(history, x_key, key)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5)
        for i, entry in enumerate(restarts(history)):
            ax.axvline(
                entry.get(x_key, 0), color="tab:red", linestyle="--", linewidth=1, label="restart" if i == 0 else None
            )
        marks = spike_marks(history, x_key) if key == "train/loss" else []
        for i, x in enumerate(marks):
            ax.axvline(
                x, color="tab:purple", linestyle="-.", linewidth=1, label="spike rolled back" if i == 0 else None
            )
        summary = spike_summary(history) if key == "train/loss" else ""
        ax.set_title(f"{key} ({summary})" if summary else key, fontsize=10)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        if restarts(history) or marks:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig)


def _learning_rate_figure(history: Sequence[Dict[str, Any]]) -> Optional[bytes]:
    xs, ys = _series(history, "time/sample", "train/lr")
    if not xs:
        return None
    fig, (ax,) = _grid(1)
    ax.plot(xs, ys, marker="o", markersize=3)
    ax.set_title("learning rate (optimizer 0, group 0, at each report)", fontsize=10)
    ax.set_xlabel("global samples")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_png(fig)


def throughput(history: Sequence[Dict[str, Any]]) -> List[Tuple[float, float]]:
    """(wall time, samples per second since the previous report of the same attempt) per report.

    An interval in which no batch ran is left out: the loop reports at batch boundaries, so such an
    interval is the end-of-run (or checkpoint) report right after another one, and its 0 samples/s
    would read as a collapse of the run's speed.
    """
    out = []
    for prev, entry in zip(history, history[1:]):
        if prev.get("attempt") != entry.get("attempt") or "wall_time" not in prev or "wall_time" not in entry:
            continue
        seconds = entry["wall_time"] - prev["wall_time"]
        samples = entry.get("time/sample", 0) - prev.get("time/sample", 0)
        batches = entry.get("time/batch", 0) - prev.get("time/batch", 0)
        if "time/batch" in entry and "time/batch" in prev and batches == 0:
            continue
        if seconds > 0 and samples >= 0:
            out.append((entry["wall_time"], samples / seconds))
    return out


def _throughput_figure(history: Sequence[Dict[str, Any]]) -> Optional[bytes]:
    timed = [e for e in history if "wall_time" in e]
    if not timed:
        return None
    start = timed[0]["wall_time"]
    fig, (ax,) = _grid(1)
    points = throughput(timed)
    if points:
        ax.plot([(t - start) / 60 for t, _ in points], [r for _, r in points], marker="o", markersize=3)
    checkpoints = [e for e in timed if e.get("checkpoint_path")]
    for i, entry in enumerate(checkpoints):
        ax.axvline(
            (entry["wall_time"] - start) / 60, color="tab:green", linestyle=":", label="checkpoint" if i == 0 else None
        )
    for i, entry in enumerate(restarts(timed)):
        ax.axvline(
            (entry["wall_time"] - start) / 60, color="tab:red", linestyle="--", label="restart" if i == 0 else None
        )
    ax.set_title("throughput (samples/s between reports)", fontsize=10)
    ax.set_xlabel("wall-clock minutes since the first report")
    ax.grid(alpha=0.3)
    if checkpoints or restarts(timed):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig)


def run_figures(history: Sequence[Dict[str, Any]]) -> Dict[str, bytes]:
    """The figures of one run (name -> PNG bytes); a figure without data is left out."""
    history = list(history)
    figures = {
        "metrics": _metrics_figure(history, "time/sample", "global samples"),
        "metrics_tokens": _metrics_figure(history, "time/token", "global tokens")
        if any(e.get("time/token") for e in history)
        else None,
        "learning_rate": _learning_rate_figure(history),
        "throughput": _throughput_figure(history),
    }
    return {name: png for name, png in figures.items() if png is not None}


def sweep_figure(
    histories: Dict[str, Sequence[Dict[str, Any]]], labels: Dict[str, str], metric: str, best: Optional[str]
) -> Optional[bytes]:
    """A sweep's ``metric`` against global samples: one line per trial, ``best`` drawn thick."""
    if not any(_series(h, "time/sample", metric)[0] for h in histories.values()):
        return None
    plt = pyplot_module()
    fig, ax = plt.subplots(figsize=(SWEEP_SIZE[0] / DPI, SWEEP_SIZE[1] / DPI), dpi=DPI)
    for trial, history in sorted(histories.items(), key=lambda kv: kv[0] == best):
        xs, ys = _series(history, "time/sample", metric)
        if not xs:
            continue
        label = f"{labels.get(trial, trial)} ({trial})" + ("  best" if trial == best else "")
        if trial == best:
            ax.plot(xs, ys, linewidth=3.5, color="black", marker="o", markersize=4, label=label, zorder=3)
        else:
            ax.plot(xs, ys, linewidth=1.2, alpha=0.8, marker="o", markersize=2, label=label)
    ax.set_title(f"{metric} by algorithm set", fontsize=11)
    ax.set_xlabel("global samples")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return save_png(fig)
