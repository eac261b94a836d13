"""The driver's one progress bar for a Ray run: the global Timestamp, loss, latest eval metric, throughput, ETA.

It polls the run's `RunHistory` actor (the aggregated reports, one entry per report round) once
a second; the bar counts in the unit of ``max_duration`` (so tqdm's ETA is the run's), and the
text after it shows the global epoch, batch and samples, the mean train loss since the previous
report, the newest eval metric and the samples per second over the current attempt.
Worker lines that reach the terminal are printed above the bar (`write`). It is fed by a
`raytrain_events.ray.reports.follow.HistoryFollower`.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

from raytrain_events.core.time import Time, report_key

__all__ = ["RunProgress", "describe_entry", "STARTING"]

STARTING = "starting Ray Train workers (the first report follows their first batches)"


def describe_entry(entry: Dict[str, Any], entries: List[Dict[str, Any]]) -> str:
    """The text after the bar for the newest history ``entry`` (``entries`` for the throughput)."""
    parts = [
        f"ep {entry.get('time/epoch', 0)}",
        f"ba {entry.get('time/batch', 0)}",
        f"sp {entry.get('time/sample', 0):,}",
    ]
    if entry.get("time/token"):
        parts.append(f"tok {entry['time/token']:,}")
    loss = next((e["train/loss"] for e in reversed(entries) if isinstance(e.get("train/loss"), float)), None)
    if loss is not None:  # the final report has no batches of its own: the last window's loss
        parts.append(f"loss {loss:.4g}")
    metric = _latest_eval_metric(entries)
    if metric is not None:
        parts.append(f"{metric[0]} {metric[1]:.4g}")
    rate = _samples_per_second(entries)
    if rate is not None:
        parts.append(f"{rate:,.0f} sp/s")
    return " | ".join(parts)


def _latest_eval_metric(entries: List[Dict[str, Any]]):
    for entry in reversed(entries):
        keys = sorted(k for k in entry if k.startswith("metrics/") and isinstance(entry[k], (int, float)))
        if keys:
            preferred = [k for k in keys if k.endswith("accuracy")] or keys
            key = preferred[0]
            return key[len("metrics/") :], float(entry[key])
    return None


def _samples_per_second(entries: List[Dict[str, Any]]) -> Optional[float]:
    """Samples per wall second over the newest attempt (a restart resets the clock)."""
    if not entries:
        return None
    attempt = entries[-1].get("attempt")
    same = [e for e in entries if e.get("attempt") == attempt and "wall_time" in e]
    while len(same) > 1 and same[-1].get("time/sample") == same[-2].get("time/sample"):
        same.pop()  # a report without new samples (the final one) is not slower training
    if len(same) < 2:
        return None
    seconds = same[-1]["wall_time"] - same[0]["wall_time"]
    samples = same[-1].get("time/sample", 0) - same[0].get("time/sample", 0)
    return samples / seconds if seconds > 0 else None


class RunProgress:
    """A tqdm bar on the driver; a `HistoryFollower` consumer (called with each batch of new entries)."""

    def __init__(self, max_duration: Time, run_name: str) -> None:
        from tqdm import tqdm

        self.duration = max_duration
        self.key = report_key(self.duration.unit)
        self._lock = threading.RLock()
        self.bar = tqdm(
            total=self.duration.value,
            unit=self.duration.unit.value,
            desc=run_name,
            dynamic_ncols=True,
            # tqdm renders a postfix as ", <text>": right after the bracket, not after a space
            bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]{postfix}",
        )
        # Until the first report (tens of seconds on a fresh cluster) the bar says what it waits for.
        self.bar.set_postfix_str(STARTING, refresh=True)

    def __call__(self, new: List[Dict[str, Any]], entries: List[Dict[str, Any]]) -> None:
        latest = next((e for e in reversed(entries) if "validation" not in e), None)  # not a late validation's
        if latest is None:
            return
        with self._lock:
            self.bar.n = min(latest.get(self.key, 0), self.duration.value)
            self.bar.set_postfix_str(describe_entry(latest, entries), refresh=True)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar."""
        with self._lock:
            self.bar.write(line, file=self.bar.fp)  # the bar's own stream, never a redirected sys.stdout

    def close(self) -> None:
        with self._lock:
            self.bar.close()
