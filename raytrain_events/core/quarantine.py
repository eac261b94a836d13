"""Culprit rows of a loss spike as pure decisions: `find_culprits` (adaptive group testing by halves) and
`Quarantine` (the rows a run no longer trains, with the data they belong to).

No torch, no I/O: the guard that replays a window and filters batches is
`raytrain_events.callbacks.spike_guard.SpikeGuard` (``bisect=True``; the replay in
``callbacks/spike_bisect.py``).

The test a group of rows answers (`excess_test`): would these rows, put into a rank's batch of otherwise
typical rows, spike it? A rank's batch of ``B`` rows spikes when its mean loss passes ``ratio x mean``
(`SpikeDetector`'s loss test, ``mean`` its trailing mean), i.e. when the rows' *excess* loss
``sum(loss_i - mean)`` passes ``(ratio - 1) x mean x B``. Excess adds over rows (clean rows add about 0),
so a group holding a culprit passes, and splitting it in halves keeps the culprit in one passing half:
the search costs about ``2 x log2(rows / culprits)`` group forwards per culprit, ``~2 x`` the window's rows
forwarded in all for one culprit (bench/spike_guard.py ``--only bisection``). A non-finite group loss passes.
A spike no single row explains (several rows each under the bar, or a gradient-norm spike whose loss looks
normal) leaves no culprit: the guard then skips the window as without bisection.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Tuple

__all__ = ["Quarantine", "excess_test", "find_culprits"]


def excess_test(loss_sum: float, rows: int, mean: float, ratio: float, batch_rows: float) -> bool:
    """True when ``rows`` rows whose losses sum to ``loss_sum`` would spike a batch of ``batch_rows`` typical rows."""
    if not math.isfinite(loss_sum):
        return True
    return loss_sum - rows * mean > (ratio - 1.0) * mean * batch_rows


def find_culprits(size: int, guilty: Callable[[int, int], bool]) -> Tuple[List[int], int]:
    """The indices in ``[0, size)`` that alone pass ``guilty`` (a test of the rows ``[a, b)``), found by halves.

    Both halves of a passing range are tested (the whole is known to have spiked: its halves are the first
    tests); a passing single row is a culprit. Returns the culprits in order and the rows tested in all
    (the sum of the tested ranges' sizes: the search's forward cost in rows).
    """
    culprits: List[int] = []
    tested = 0
    stack = [(0, size)]
    while stack:
        a, b = stack.pop()
        if b - a == 1:
            culprits.append(a)
            continue
        mid = (a + b) // 2
        for lo, hi in ((mid, b), (a, mid)):  # the lower half popped first: culprits come out in order
            tested += hi - lo
            if guilty(lo, hi):
                stack.append((lo, hi))
    return culprits, tested


@dataclass
class Quarantine:
    """Rows a run does not train any more: each row's id (the value of the batch column ``row_key``) and
    where it was quarantined (``epoch``, global ``position``: the first position of its spike's window).

    ``fingerprint`` names the data the ids belong to (the row key, and the mixture's sources or the
    length of the loader's dataset): a quarantine loaded into a run on other data is refused (`check_fingerprint`).
    Saved in every checkpoint with the guard's state; `dumps`/`loads` make the file a later run passes.
    """

    rows: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # id -> (epoch, position)
    fingerprint: Dict[str, Any] = field(default_factory=dict)

    def add(self, row: int, epoch: int, position: int) -> None:
        self.rows.setdefault(int(row), (int(epoch), int(position)))

    def __contains__(self, row: object) -> bool:
        return row in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def ids(self) -> List[int]:
        return sorted(self.rows)

    def describe(self) -> str:
        return ", ".join(f"row {r} (epoch {e}, position {p})" for r, (e, p) in sorted(self.rows.items())) or "nothing"

    def check_fingerprint(self, fingerprint: Mapping[str, Any]) -> None:
        """Refuse a quarantine recorded on other data (another row key, mixture sources or dataset length)."""
        differ = {k: (self.fingerprint[k], fingerprint[k]) for k in fingerprint if k in self.fingerprint}
        differ = {k: v for k, v in differ.items() if v[0] != v[1]}
        if differ:
            said = ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
            raise ValueError(
                f"The quarantine was recorded for other data ({said}): its row ids would name other rows. "
                "Pass a quarantine file of this dataset (or mixture), or none."
            )

    def merge(self, other: Quarantine) -> None:
        """Take ``other``'s rows (a file passed by the user) after checking it names the same data."""
        other.check_fingerprint(self.fingerprint)  # "there": the file's data, "here": this run's
        for key, value in other.fingerprint.items():
            self.fingerprint.setdefault(key, value)
        for row, (epoch, position) in other.rows.items():
            self.add(row, epoch, position)

    def state_dict(self) -> Dict[str, Any]:
        return {"rows": [[r, e, p] for r, (e, p) in sorted(self.rows.items())], "fingerprint": dict(self.fingerprint)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Quarantine:
        out = cls(fingerprint=dict(state.get("fingerprint", {})))
        for row, epoch, position in state.get("rows", ()):
            out.add(row, epoch, position)
        return out

    def dumps(self) -> str:
        """The file a later run passes (``SpikeGuard(quarantine_from=...)``): JSON, one entry per row."""
        return json.dumps({"format": "raytrain_events.quarantine/1", **self.state_dict()}, indent=1)

    @classmethod
    def loads(cls, text: str, where: str = "the quarantine file") -> Quarantine:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where} is not a quarantine file (not JSON: {exc}).") from None
        if not isinstance(data, dict) or data.get("format") != "raytrain_events.quarantine/1":
            raise ValueError(
                f"{where} is not a quarantine file (no 'format': 'raytrain_events.quarantine/1'); write one with "
                "`raytrain-events ledger RUN --export-quarantine FILE` or `guard.quarantine.dumps()`."
            )
        return cls.from_state_dict(data)
