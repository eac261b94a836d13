"""The run report's mixture weights over time: the weights history an online policy saved in the newest checkpoint.

A run whose `Mixture` has ``online=`` keeps its weights history in each checkpoint (the
`OnlineMixture` callback's state: each change's global sample, batch, old and new weights and the
losses that chose them). The report reads it from the newest committed checkpoint (its state file,
as ``raytrain-events ledger`` does) and draws each source's weight against global samples as a step
line, then lists the changes. Nothing is drawn for a run without an online mixture.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.report import html
from raytrain_events.report.plots import _grid, save_png
from raytrain_events.storage.run_dir import STATE_FILE, RunDir

__all__ = ["saved_weights_history", "weights_figure", "weights_sections"]

FIGURE = "mixture_weights.png"


def saved_weights_history(url: str, options: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """The newest checkpoint's weights history (``[{position, batch, old, new, losses}, ...]``), or None."""
    from raytrain_events.checkpoint.folder.store import latest_checkpoint  # why here: checkpoint/ imports torch
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files  # why here: imports torch

    try:
        info = latest_checkpoint(RunDir(url, options).checkpoints, storage_options=options)
        if info is None:
            return None
        state = read_checkpoint_files(info, storage_options=options, files=[STATE_FILE]).files[STATE_FILE]
    except Exception:  # noqa: BLE001 -- an unreadable checkpoint: the report goes on without this section
        return None
    callbacks = state.get("callbacks") or {}
    online = next((v for k, v in callbacks.items() if k.split("#")[0] == "OnlineMixture"), None)
    return list(online["history"]) if online else None


def weights_figure(history: List[Dict[str, Any]], end: Optional[int] = None) -> Optional[bytes]:
    """Each source's weight against global samples (a step line: a weight holds until the next change)."""
    if not history:
        return None
    names = sorted(history[0]["old"])
    xs = [0] + [int(c["position"]) for c in history]
    last = end if end is not None and end > xs[-1] else xs[-1] + max(1, xs[-1] // max(1, len(history)))
    fig, (ax,) = _grid(1)
    for name in names:
        ys = [float(history[0]["old"][name])] + [float(c["new"][name]) for c in history]
        ax.step(xs + [last], ys + [ys[-1]], where="post", label=name, linewidth=1.5)
    for x in xs[1:]:
        ax.axvline(x, color="0.8", linewidth=0.6, zorder=0)
    ax.set_title("mixture weights (online policy): each change at its global sample", fontsize=10)
    ax.set_xlabel("global samples")
    ax.set_ylabel("weight")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig)


def weights_sections(
    url: str, options: Dict[str, Any], end: Optional[int] = None
) -> Tuple[List[str], Dict[str, bytes]]:
    """The report's sections and figure for the run's weights history (empty without one)."""
    history = saved_weights_history(url, options)
    png = weights_figure(history or [], end)
    if png is None or not history:
        return [], {}
    names = sorted(history[0]["old"])
    rows = [
        [
            c["position"],
            c["batch"],
            *(f"{c['old'][n]:.3f} -> {c['new'][n]:.3f}" for n in names),
            ", ".join(f"{n} {c['losses'][n]:.4f}" for n in names),
        ]
        for c in history
    ]
    sections = [
        "<h2>Mixture weights over time (online policy)</h2>",
        html.image(FIGURE, "mixture weights against global samples"),
        html.table(["global sample", "batch", *names, "eval losses that chose them"], rows),
    ]
    return sections, {FIGURE: png}
