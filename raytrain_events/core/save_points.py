"""Save points under replica groups: which group saves what after the saving lead is lost.

Every replica group holds the same committed state, so one group, the *lead* (the lowest group of the step's
quorum), saves each save point's checkpoint for all. A lead can die after its step committed and before its
checkpoint is committed (its upload in flight): the other groups committed that step too, nobody trains it
again, and without this the save point would have no checkpoint. The state of that save point is gone by then
(the survivors learn of the death at their next all-reduce, one or more steps later), so the next lead saves
*late*: at its first committed step, once, with the `Timestamp` of that step, recorded as standing in for the
missed save points (`LateSave`). Keeping the save point's own state instead would cost every save a host copy of
the whole state on a second group (``docs/operating.md`` weighs both); a late save costs nothing when nothing
fails.

`SavePoints` is one group's record of the save points another group led (`passed`). When this group becomes the
lead (`take_missed`) it compares them with the newest committed checkpoint of the folder (one index read, done
anyway at a change of lead): those after it have no checkpoint, and the new lead saves once for all of them. A
save point the old lead did commit (its manifest is there, even if its index update was not) is not saved again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["LateSave", "SavePoints"]


@dataclass(frozen=True)
class LateSave:
    """A save made at a later committed step for save points whose lead died before committing them."""

    missed: Tuple[int, ...]  #: the missed save points' batches, oldest first

    def __post_init__(self) -> None:
        if not self.missed:
            raise ValueError("LateSave() stands in for at least one missed save point.")


class SavePoints:
    """One replica group's record of the save points another group led since this group last checked."""

    def __init__(self) -> None:  # noqa: D107
        self.led_elsewhere: List[int] = []  # batches, oldest first (a few ints per save interval followed)

    def passed(self, batch: int) -> None:
        """A save point at ``batch``, a committed step, that another group (the lead) saves."""
        if not self.led_elsewhere or self.led_elsewhere[-1] != batch:
            self.led_elsewhere.append(batch)

    @property
    def pending(self) -> bool:
        """Whether another group led a save point this group has not checked since."""
        return bool(self.led_elsewhere)

    def take_missed(self, newest_committed: Optional[int]) -> Optional[LateSave]:
        """This group leads now: the save points no committed checkpoint covers (after ``newest_committed``, the
        newest committed checkpoint's batch, None if none), as one `LateSave`, or None; forgets them either way."""
        missed = tuple(b for b in self.led_elsewhere if newest_committed is None or b > newest_committed)
        self.led_elsewhere = []
        return LateSave(missed) if missed else None
