"""Replica groups: a peer's failure ends every survivor's pending all-reduce at once, wherever it sits in the ring.

gloo's all-reduce is a ring. When one group dies mid all-reduce (SIGKILL, a lost process), its two ring
neighbours see the closed connection within a fraction of a second, but a group further round the ring waits
for data from a live neighbour that has stopped sending, and gloo gives it no way out before its receive
timeout (``replica_timeout_s``, 30 s by default). torch 2.13's ``abort()`` on a gloo process group does not
end a pending receive (checked here: the wait ran to the peer's exit), and dropping the process group joins
its worker threads, which blocks for the same timeout. So, with 4 or more groups, one failure stalled every
group for the whole timeout, and the quorum (all but one group) could not form without the stalled one.

What is done instead, in torchft's own terms:

- `AbortableGloo` is torchft's reconfigurable ``ProcessGroupGloo`` with two additions. At each quorum's
  ``configure`` it opens a client on that quorum's store (the store every member of the quorum already uses
  to form the process group, under a prefix of its own), the quorum's **abort board**. And it keeps a process
  group whose all-reduce was abandoned (below) alive until that all-reduce has ended on its own, so the next
  quorum's reconfiguration does not wait on it.
- `CollectiveWatch.wait` waits for the step's all-reduce in short slices. A group whose all-reduce failed
  (a neighbour of the dead group: torchft's ``Manager`` recorded the error) writes the board's key; a group
  still waiting reads the board between slices and, when the key is there (or the store itself is gone: the
  dead group was the one that hosted it), abandons its all-reduce and reports the error to the ``Manager``
  (``report_error``): the step does not commit, as if its own all-reduce had failed.

Every survivor then asks for the next quorum; the Lighthouse drops the dead group once its heartbeat is
``HEARTBEAT_TIMEOUT_MS`` old, the quorum forms without it and training goes on. A failure costs the survivors
the failed step, the heartbeat detection and one quorum, at any number of groups. What it does not cover: a
peer that stops without closing its connections (a lost node whose kernel sends no reset) fails no neighbour
at once, so every group waits for gloo's timeout, as before.

Cost per step: none while the all-reduce ends within one slice (``poll_s``, 50 ms: the wait wakes when it
ends, through the work's future); after that, one store read per slice of waiting. Per quorum: one store client (a TCP connection to the quorum's store host).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, List, Optional, Tuple

from torchft.process_group import ProcessGroupGloo, create_store_client

__all__ = ["ABORT_KEY", "AbortableGloo", "CollectiveWatch", "PeerFailedError"]

log = logging.getLogger(__name__)

#: The key a group whose all-reduce failed writes on its quorum's abort board.
ABORT_KEY = "abort"
#: How long a read of the board may take: it is on the step's path only when the all-reduce is already late.
BOARD_TIMEOUT = datetime.timedelta(seconds=2)


class PeerFailedError(RuntimeError):
    """A group of this step's quorum failed: this group's all-reduce was abandoned (the step does not commit)."""


class AbortableGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo process group, with its quorum's abort board (see the module doc)."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self.board: Any = None  # this quorum's abort board (a store client), set at each configure
        self.pending: Any = None  # the newest collective's gloo work (`_wrap_work`)
        self._abandoned: List[Tuple[Any, Any]] = []  # (process group, its abandoned work) kept until it ends
        self.quorum_id: Optional[int] = None

    def configure(  # noqa: PLR0913 (torchft's signature)
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        self._abandoned = [(pg, work) for pg, work in self._abandoned if not work.is_completed()]
        self.board = None
        self.pending = None
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        self.quorum_id = quorum_id
        try:
            # One board per quorum for every position of the groups (torchft's ``store_addr`` ends in the position:
            # ``.../torchft/<quorum>/<group_rank>``): a failure at one position ends the others' waits too.
            board = store_addr.rsplit("/", 1)[0] if group_rank is not None else store_addr
            self.board = create_store_client(f"{board}/raytrain_abort", BOARD_TIMEOUT)
        except Exception as error:  # the store host is gone already: the quorum's collectives fail on their own
            log.warning("replica groups: no abort board for quorum %s (%s)", quorum_id, error)

    def _wrap_work(self, work: Any, opts: object) -> Any:
        self.pending = work
        return work

    def abandon(self) -> None:
        """Leave the pending collective to gloo's timeout and keep its process group alive until then."""
        if self.pending is not None and self._pg is not None:
            self._abandoned.append((self._pg, self.pending))
        self.pending = None

    def post_abort(self, who: str) -> None:
        """Tell the quorum's other groups that a collective of this quorum failed here."""
        if self.board is None:
            return
        try:
            self.board.set(ABORT_KEY, who)
        except Exception:  # the store's host is the group that died: the others see the board gone
            pass

    def abort_posted(self) -> bool:
        """Whether a group of this quorum posted an abort, or the board itself is gone (its host died)."""
        if self.board is None:
            return False
        try:
            return bool(self.board.check([ABORT_KEY]))
        except Exception:
            return True


class CollectiveWatch:
    """Wait for one step's all-reduce, or abandon it when another group of the quorum failed (module doc)."""

    def __init__(self, pg: AbortableGloo, name: str, poll_s: float = 0.05) -> None:
        self.pg = pg
        self.name = name
        self.poll_s = poll_s
        self.abandoned = 0  # all-reduces this group abandoned (what the tests count)

    def allreduce(self, manager: Any, tensor: Any) -> None:
        """The Manager's all-reduce (an average over the participants) of ``tensor``, in place; returns when it
        ended, failed (and this group posted it), or was abandoned (another group posted). The Manager records any
        failure (``manager.errored()``): the step then does not commit."""
        self.pg.pending = None
        work = manager.allreduce(tensor)
        raw = self.pg.pending  # None when the Manager had already errored (torchft then runs no collective)
        if raw is not None and not raw.is_completed():
            done = threading.Event()
            raw.get_future().add_done_callback(lambda _: done.set())  # wakes the wait at once when it ends
            started = time.monotonic()
            while not done.wait(self.poll_s):
                if self.pg.abort_posted():
                    self.pg.abandon()
                    self.abandoned += 1
                    waited = time.monotonic() - started
                    manager.report_error(
                        PeerFailedError(f"a group of quorum {self.pg.quorum_id} failed; abandoned after {waited:.2f} s")
                    )
                    log.warning("replica groups: a peer failed mid all-reduce; abandoned it after %.2f s", waited)
                    return
        work.wait()  # torchft's: runs the averaging, records an error with the Manager
        if manager.errored() is not None:
            self.pg.post_abort(self.name)
