"""`Agreement`: flags one rank asks for and all ranks agree on at the same batch.

A clock, a signal handler or a preemption notice fires on one rank, but a checkpoint or a
report to the driver is a collective: every rank must act at the same batch. So a component
*registers* a flag once (on every rank, before training), *requests* it on whichever rank
wants it, and after the batch's counter collective reads whether it was *agreed*: asked on
at least one rank. The loop sums every registered flag in the one collective it runs per
batch anyway, so a new feature needs no change of `State` or of the loop.

Example::

    state.agreement.register("save")      # in the component's __init__, on every rank
    state.agreement.request("save")       # on the rank whose timer fired
    ...                                   # the loop's per-batch collective
    if state.agreement.agreed("save"):    # at BATCH_END or later: same answer on every rank
        save()
        state.agreement.clear("save")

A *count* rides on the same sum: `register_count` once, `set_count` this rank's value before
each batch (it is summed as it stands, so set it every batch), `total` after the batch reads
the sum over ranks. The per-source samples and tokens of a `Mixture` are counted so.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

__all__ = ["Agreement", "StepVote"]


@runtime_checkable
class StepVote(Protocol):
    """A vote that decides whether each step commits, and carries a few integers of every participant with it.

    Replica groups (torchft) have no collective across the groups but the step's gradient all-reduce and its
    commit vote (``ray/replica_groups.py``: `ReplicaCommit`, a callback); each group's `Agreement` is its own. A
    component that needs every group to decide the same (`SpikeGuard`) finds it among the callbacks at INIT and
    hands it a ``vote`` function, called before the step's all-reduce; after the step `vote_sums` gives the
    votes summed over the step's participants, or None when the step did not commit (it counts for nothing).

    A replica group of several workers (a model sharded inside each group) all-reduces across the groups once per
    *position* (each worker its own shards, with the same position of the other groups), so every worker of every
    group reads the same sums only if the workers of one group vote the same: they vote on values summed over their
    own group first (`group_sum`: the group's loss over all its rows, its gradient norm over all its shards).
    """

    def carry(self, vote: Callable[[], List[int]]) -> None:
        """Add ``vote()`` (small non-negative integers, the same count every step) to every step's all-reduce."""
        ...

    def vote_sums(self) -> Optional[Tuple[List[int], int]]:
        """The latest step's summed votes and its number of participants; None if that step did not commit."""
        ...

    def group_sum(self, values: List[float]) -> List[float]:
        """``values`` summed over the workers of this replica group (its own process group, the one its model is
        sharded over; a collective every worker of the group calls at the same point), the values themselves in a
        group of one worker."""
        ...


class Agreement:
    """Named flags: requested on this rank, agreed by all ranks once per batch."""

    __slots__ = ("_names", "_requested", "_agreed", "_values", "_counts", "_totals", "_nonzero")

    def __init__(self) -> None:
        self._names: List[str] = []
        self._requested: Dict[str, bool] = {}
        self._agreed: Dict[str, bool] = {}
        self._values: List[int] = []  # 0/1 per registered flag (any int >= 0 for a count), in ``_names`` order
        self._counts: Dict[str, int] = {}  # count name -> its index in ``_names``
        self._totals: Dict[str, int] = {}  # count name -> its sum over ranks at the latest batch
        # Whether the latest sums had a value above 0. While False every flag is not agreed and every total is 0
        # (`clear` only lowers, `register` adds a flag at 0): all-zero sums then change nothing (`set_sums`).
        self._nonzero = False

    # --------------------------------------------------------------- setup
    def register(self, name: str) -> None:
        """Declare the flag ``name`` (idempotent). Every rank must register the same flags."""
        if name not in self._requested:
            self._names.append(name)
            self._names.sort()  # the same order on every rank, whatever the registration order
            self._requested[name] = False
            self._agreed[name] = False
            self._values = [1 if self._requested[n] else 0 for n in self._names]
            self._counts = {n: self._names.index(n) for n in self._counts}

    def register_count(self, name: str) -> None:
        """Declare ``name`` as a count (idempotent): an int per rank that the loop sums every batch."""
        if name not in self._counts:
            self.register(name)
            self._counts[name] = self._names.index(name)
            self._totals[name] = 0

    @property
    def names(self) -> Tuple[str, ...]:
        """The registered flags, in the order the loop sums them."""
        return tuple(self._names)

    # ------------------------------------------------------------ this rank
    def request(self, name: str) -> None:
        """Ask for ``name`` on this rank; it stays asked until `clear`."""
        self._check(name)
        self._requested[name] = True
        self._values[self._names.index(name)] = 1

    def requested(self, name: str) -> bool:
        """True if ``name`` was asked on this rank and not cleared since (not agreed yet)."""
        self._check(name)
        return self._requested[name]

    # ------------------------------------------------------------ all ranks
    def agreed(self, name: str) -> bool:
        """True if some rank asked for ``name`` before the latest batch's collective."""
        try:  # (read every batch: one lookup; an unregistered name raises the fix, as `_check` says it)
            return self._agreed[name]
        except KeyError:
            self._check(name)
            raise

    def clear(self, name: str) -> None:
        """The request was acted on: forget it on this rank (asked and agreed)."""
        self._check(name)
        self._requested[name] = False
        self._agreed[name] = False
        self._values[self._names.index(name)] = 0

    def set_count(self, name: str, value: int) -> None:
        """This rank's value of the count ``name`` for the coming batch (>= 0)."""
        index = self._counts.get(name)
        if index is None:
            raise KeyError(f"Count {name!r} is not registered; call state.agreement.register_count({name!r}) first.")
        self._values[index] = value

    def total(self, name: str) -> int:
        """The count ``name`` summed over all ranks at the latest batch."""
        return self._totals[name]

    # ------------------------------------------------------------- the loop
    def local_values(self) -> List[int]:
        """This rank's requests as 0/1 ints, in `names` order (what the loop sums)."""
        return self._values

    def one_process_sums(self) -> Optional[List[int]]:
        """In a one-process run, what `set_sums` gets after the batch: this rank's values as asked before it (a copy:
        a hook may ask during the batch), or None when they would change nothing (all zero, after all-zero sums:
        nearly every batch), so the loop makes no copy and no call."""
        if not self._nonzero and not any(self._values):
            return None
        return self._values.copy()

    def set_sums(self, sums: Sequence[int]) -> None:
        """Record the summed requests of all ranks (the loop calls this once per batch)."""
        if len(sums) != len(self._names):
            raise ValueError(f"Got {len(sums)} flag sums for {len(self._names)} registered flags {self._names}.")
        nonzero = any(sums)
        if not nonzero and not self._nonzero:  # most batches: nothing asked, nothing agreed or counted before
            return
        self._nonzero = nonzero
        for name, total in zip(self._names, sums):
            self._agreed[name] = total > 0
        for name, index in self._counts.items():
            self._totals[name] = int(sums[index])

    def _check(self, name: str) -> None:
        if name not in self._requested:
            raise KeyError(
                f"Flag {name!r} is not registered (registered: {self._names}); call "
                f"state.agreement.register({name!r}) on every rank before training."
            )
