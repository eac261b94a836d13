"""Goodput of a run: the share of wall time spent on batches that count, and what each restart cost.

From what a `RayTrainer` run saved in its directory: ``history.jsonl`` (each worker group, an
*attempt*, starts with ``attempt_started_at`` and ``resumed_from_batch``; each report has its
``wall_time`` and global ``time/batch``), the watchdog's ``hangs/<group>/hang.json``, the
preemption guard's ``preemptions/batch-<N>.json`` and the controller's record of each failed group
(``failures/at-<ms>.json``, `raytrain_events.ray.reports.failures`).

Per attempt the reports give a curve batch(t). A batch *counts* if no later attempt trained it
again: attempt ``a``'s batches up to the batch attempt ``a + 1`` resumed from. Its time is the
slope of the curve where it was trained (the first stretch of an attempt, which holds its
start-up, takes the attempt's median slope instead). Then:

* ``goodput = time on counted batches / wall time`` (wall time from the first group's start to
  the last report);
* **time lost per failure** ``a``: from the moment attempt ``a`` had trained the batch the next
  attempt resumed from, to the moment attempt ``a + 1`` was back there (its first report's time
  less its batches since the resume at its own pace): the work done again, the detection time
  (a hang's timeout) and the restart;
* its **cause**: a hang (the watchdog's record in that window: the slowest rank and its frame),
  a preemption (SIGTERM saved and stopped), else a lost worker or node (with the failed ranks' errors
  where the controller recorded the failure). A group that failed before its first report has no
  attempt of its own: its failure is in the same window, after the first, and the restart lists each
  failure's cause in order (``failures`` counts them);
* **quorum changes** of a replica-groups run (``quorum_change`` entries: a group left or joined,
  no restart): marked on the chart at their time, with the groups before and after.

Example::

    summary = goodput(read_history(run_url), hang_records, preemption_records, read_failures(run_url))
    summary["goodput"], [(r["cause"], r["lost_s"]) for r in summary["restarts"]]
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from raytrain_events.report import html
from raytrain_events.report.plots import grid_size, pyplot_module, save_png
from raytrain_events.storage.fs import resolve
from raytrain_events.storage.run_dir import RunDir

__all__ = ["goodput", "read_events", "read_failures", "goodput_figure", "goodput_section"]

#: The cause of a restart no record explains.
LOST = "a worker or node was lost"

Point = Tuple[float, int]  # (wall time, global batch)


def _attempts(history: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per attempt: its number, start (wall, batch) and the (wall, batch) of each report."""
    attempts: Dict[int, Dict[str, Any]] = {}
    for entry in history:
        if "wall_time" not in entry or "time/batch" not in entry:
            continue
        number = int(entry.get("attempt", 1))
        attempt = attempts.setdefault(number, {"attempt": number, "points": [], "start": None, "world": None})
        if attempt["world"] is None and entry.get("world_size") is not None:
            attempt["world"] = int(entry["world_size"])
        if attempt["start"] is None:
            resumed = int(entry.get("resumed_from_batch", 0))
            started = entry.get("attempt_started_at")
            attempt["start"] = (float(started), resumed) if started is not None else None
        attempt["points"].append((float(entry["wall_time"]), int(entry["time/batch"])))
    out = [attempts[k] for k in sorted(attempts)]
    for attempt in out:
        if attempt["start"] is None:  # an older history: the first report stands for the start
            wall, batch = attempt["points"][0]
            attempt["start"] = (wall, batch)
    return out


def _pace(points: List[Point]) -> Optional[float]:
    """Median seconds per batch between consecutive reports (None: fewer than two reports)."""
    slopes = [(w2 - w1) / (b2 - b1) for (w1, b1), (w2, b2) in zip(points, points[1:]) if b2 > b1]
    return statistics.median(slopes) if slopes else None


def _time_at(points: List[Point], batch: int, pace: float) -> float:
    """When the attempt with reports ``points`` had trained ``batch`` (interpolated, or at its pace)."""
    for (w1, b1), (w2, b2) in zip(points, points[1:]):
        if b1 <= batch <= b2 and b2 > b1:
            return w1 + (w2 - w1) * (batch - b1) / (b2 - b1)
    wall, last = points[-1]
    return wall + (batch - last) * pace if batch > last else points[0][0] - (points[0][1] - batch) * pace


def _cause(
    start: float, end: float, hangs: List[Dict[str, Any]], preemptions: List[Dict[str, Any]], worlds: Tuple[Any, Any]
) -> str:
    for hang in hangs:
        if start <= hang.get("wall", -1) <= end:
            if hang.get("frame") is None:  # the rank wrote no stack: its process was frozen or stopped
                return f"hang: rank {hang.get('slowest_rank')}, frozen or stopped (no stack dump)"
            return f"hang: rank {hang.get('slowest_rank')} at batch {hang.get('batch')}, in {hang.get('frame')}"
    for record in preemptions:
        if start <= record.get("wall", -1) <= end:
            # A SIGTERM stops the ranks at the save; a notice saves, and the node's loss ends the group.
            how = "" if record.get("stopping") else f", saved at batch {record.get('saved_batch')}, then the node went"
            return f"preemption: {record.get('cause')} on rank {record.get('rank')}{how}"
    before, after = worlds
    if before is not None and after is not None and after > before:  # Ray's elastic resize: no failure
        return f"resized: the group grew from {before} to {after} workers"
    return LOST


def _failure_causes(
    start: float,
    end: float,
    failures: List[Dict[str, Any]],
    hangs: List[Dict[str, Any]],
    preemptions: List[Dict[str, Any]],
) -> List[str]:
    """The cause of each failure recorded between two attempts' starts, in order: the hang or preemption record in
    its own window (since the failure before it), else the failed ranks' errors. Every failure after the first
    was of a group that restarted and failed again before its first report."""
    inside = sorted((f for f in failures if start < float(f.get("wall", -1)) <= end), key=lambda f: float(f["wall"]))
    causes = []
    since = start
    for i, failure in enumerate(inside):
        cause = _cause(since, float(failure["wall"]), hangs, preemptions, (None, None))
        if cause == LOST:
            errors = failure.get("errors") or {}  # a rank that died first (`failure_record`)
            first = next(iter(errors.items()), None)
            died = " died" if first and int(first[0]) in failure.get("died", ()) else ""
            more = f" and {len(errors) - 1} more rank(s)" if len(errors) > 1 else ""
            cause = f"{LOST} (rank {first[0]}{died}: {first[1]}{more})" if first else LOST
        causes.append(cause if i == 0 else f"then its restart failed before its first report: {cause}")
        since = float(failure["wall"])
    return causes


def goodput(
    history: Sequence[Dict[str, Any]],
    hangs: Sequence[Dict[str, Any]] = (),
    preemptions: Sequence[Dict[str, Any]] = (),
    failures: Sequence[Dict[str, Any]] = (),
) -> Dict[str, Any]:
    """The run's goodput, wall time, counted time and each restart: cause, resumed batch, time lost, and how many
    failed groups it took (``failures``: the controller's records, `read_failures`; without them, 1 each)."""
    attempts = _attempts(history)
    if not attempts:
        return {"goodput": None, "wall_s": 0.0, "counted_s": 0.0, "restarts": [], "attempts": [], "quorum_changes": []}
    paces = [_pace([a["start"]] + a["points"][1:]) or _pace(a["points"]) for a in attempts]
    known = [p for p in paces if p is not None]
    default_pace = statistics.median(known) if known else 0.0
    paces = [pace if pace is not None else default_pace for pace in paces]
    counted = 0.0
    restarts = []
    rows = []
    for i, attempt in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        row = _attempt_row(attempt, nxt, paces[i])
        counted += row["counted_batches"] * paces[i]
        rows.append(row)
        if nxt is not None:
            records = (list(hangs), list(preemptions), list(failures))
            restarts.append(_restart(attempt, nxt, paces[i], paces[i + 1], records))
    wall = attempts[-1]["points"][-1][0] - attempts[0]["start"][0]
    return {
        "quorum_changes": _quorum_changes(history),
        "goodput": None if wall <= 0 else min(1.0, counted / wall),
        "wall_s": wall,
        "counted_s": counted,
        "restarts": restarts,
        "attempts": rows,
    }


def _attempt_row(attempt: Dict[str, Any], nxt: Optional[Dict[str, Any]], pace: float) -> Dict[str, Any]:
    """One attempt's span and its batches that count: those up to where the next attempt resumed (all, if last)."""
    start_wall, start_batch = attempt["start"]
    end_batch = attempt["points"][-1][1]
    until = nxt["start"][1] if nxt is not None else end_batch
    return {
        "attempt": attempt["attempt"],
        "start_wall": start_wall,
        "end_wall": attempt["points"][-1][0],
        "from_batch": start_batch,
        "to_batch": end_batch,
        "counted_batches": max(0, min(until, end_batch) - start_batch),
        "pace_s": pace,
    }


def _restart(
    attempt: Dict[str, Any],
    nxt: Dict[str, Any],
    pace: float,
    next_pace: float,
    records: Tuple[List[Dict[str, Any]], List[Dict[str, Any]], List[Dict[str, Any]]],
) -> Dict[str, Any]:
    """What the failure that ended ``attempt`` cost: from when it had trained the batch ``nxt`` resumed from, to when
    ``nxt`` was back there (its first report less its batches since the resume at its own pace); and its cause (each
    failure's, where the controller recorded more than one: ``records`` are the hangs, preemptions and failures)."""
    hangs, preemptions, failures = records
    start, end = attempt["start"][0], nxt["start"][0]
    causes = _failure_causes(start, end, failures, hangs, preemptions)
    failed = len(causes)
    if not causes:  # no controller record (an older run): the window's record, or a resize (no failure)
        causes = [_cause(start, end, hangs, preemptions, (attempt["world"], nxt["world"]))]
        failed = 0 if causes[0].startswith("resized") else 1
    resume = nxt["start"][1]
    left = _time_at([attempt["start"]] + attempt["points"], resume, pace)
    first_wall, first_batch = nxt["points"][0]
    back = first_wall - (first_batch - resume) * next_pace
    return {
        "attempt": nxt["attempt"],
        "resumed_from_batch": resume,
        "failed_at_batch": attempt["points"][-1][1],
        "left_wall": left,
        "back_wall": back,
        "lost_s": max(0.0, back - left),
        "cause": "; ".join(causes),
        "failures": failed,
    }


def _quorum_changes(history: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """A replica-groups run's quorum changes (a group left or joined, no restart): time, batch, groups, change."""
    return [
        {
            "wall": float(e["wall_time"]),
            "batch": int(e["time/batch"]),
            "groups": int(e["replica_groups"]),
            "change": int(e["quorum_change"]),
        }
        for e in history
        if e.get("quorum_change") is not None
    ]


def _read_records(run: RunDir, pattern: str) -> List[Dict]:
    fs, glob = resolve(pattern, run.storage_options)
    found = []
    for path in sorted(fs.glob(glob)):
        try:
            found.append(json.loads(fs.cat_file(path).decode("utf-8")))
        except (OSError, ValueError):
            continue  # a record being written, or damaged: the report still renders
    return found


def read_events(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[List[Dict], List[Dict]]:
    """The run dir's hang records (``hangs/*/hang.json``) and preemption records (``preemptions/*.json``)."""
    run = RunDir(url, dict(storage_options or {}))
    return _read_records(run, run.hang_records), _read_records(run, run.preemption_records)


def read_failures(url: str, storage_options: Optional[Dict[str, Any]] = None) -> List[Dict]:
    """The run dir's records of failed worker groups (``failures/*.json``, `raytrain_events.ray.reports.failures`)."""
    run = RunDir(url, dict(storage_options or {}))
    return _read_records(run, run.failure_records)


def goodput_figure(summary: Dict[str, Any]) -> Optional[bytes]:
    """Each attempt as a bar on the wall-clock axis: counted time green, lost time red, causes labelled."""
    if not summary["attempts"]:
        return None
    plt = pyplot_module()
    width, height = grid_size(1)
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
    t0 = summary["attempts"][0]["start_wall"]
    for row in summary["attempts"]:
        y = row["attempt"]
        ax.barh(y, (row["end_wall"] - row["start_wall"]) / 60, left=(row["start_wall"] - t0) / 60, color="#4caf50")
    for restart in summary["restarts"]:
        left = (restart["left_wall"] - t0) / 60
        ax.barh(restart["attempt"] - 0.5, restart["lost_s"] / 60, left=left, height=0.3, color="#e53935")
        ax.annotate(
            f"{restart['cause'][:60]} ({restart['lost_s']:.0f} s lost)",
            (left, restart["attempt"] - 0.5),
            fontsize=7,
            xytext=(3, 6),
            textcoords="offset points",
        )
    for change in summary.get("quorum_changes", []):  # a replica group left (red) or joined (green): no restart
        x = (change["wall"] - t0) / 60
        ax.axvline(x, color="#e53935" if change["change"] < 0 else "#43a047", linestyle="--", linewidth=1)
        before = change["groups"] - change["change"]
        ax.annotate(f"groups {before}->{change['groups']} (batch {change['batch']})", (x, 1), fontsize=7, rotation=90)
    good = summary["goodput"]
    ax.set_title(f"Goodput {good:.1%}" if good is not None else "Goodput")
    ax.set_xlabel("wall-clock minutes since the first worker group started")
    ax.set_ylabel("attempt")
    return save_png(fig)


def goodput_section(summary: Dict[str, Any]) -> List[str]:
    """HTML for the run report: goodput, and a table of restarts with cause and time lost."""
    if summary["goodput"] is None:
        return []
    parts = [
        "<h2>Goodput and restarts</h2>",
        f"<p>Goodput {summary['goodput']:.1%}: {summary['counted_s']:.0f} s of batches that count in "
        f"{summary['wall_s']:.0f} s of wall time; {len(summary['restarts'])} restart(s) after "
        f"{sum(r.get('failures', 1) for r in summary['restarts'])} failed worker group(s), "
        f"{sum(r['lost_s'] for r in summary['restarts']):.0f} s lost to them.</p>",
    ]
    if summary.get("quorum_changes"):
        changes = ", ".join(
            f"{c['groups'] - c['change']}->{c['groups']} groups at batch {c['batch']}"
            for c in summary["quorum_changes"]
        )
        parts.append(f"<p>Replica-group quorum changes (no restart): {changes}.</p>")
    if summary["restarts"]:
        parts.append(
            html.table(
                ["attempt", "cause", "failed groups", "failed at batch", "resumed from batch", "time lost (s)"],
                [
                    [
                        r["attempt"],
                        r["cause"],
                        r.get("failures", 1),
                        r["failed_at_batch"],
                        r["resumed_from_batch"],
                        round(r["lost_s"], 1),
                    ]
                    for r in summary["restarts"]
                ],
            )
        )
    return parts
