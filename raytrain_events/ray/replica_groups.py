"""Replica groups on the worker: the loop under torchft, each step committed or trained again.

With ``RayTrainer(fault_tolerance="replica_groups", num_workers=k)`` the driver runs Ray Train with
``TorchftConfig`` (a torchft Lighthouse as a Ray actor; a failed worker's group is restarted by Ray
alone while the others train on) and each worker builds its `Trainer` with the parts here (put together
by the run's strategy, `ray/fault_tolerance/replica_groups.py`):

- one torchft ``Manager`` per group (`build_manager`), its gloo process group across the groups
  and ``PGTransport`` for live recovery: a group that (re)joins gets model, optimizer, schedulers,
  torch RNG and the loop's `Timestamp` from a healthy peer at its first quorum (`ReplicaState`),
  not from storage;
- `ReplicaLoader` (``replica_loader.py``): before each step, a quorum (synchronous: a joining group heals there); then the
  global batch at the state's position in the global order (`feeder.py`, every group is served the
  whole global batch), cut into one part per *participating* group. A group's share goes to the
  others while it is away: the global batch, the step's samples and the LR schedule stay those of
  an uninterrupted run;
- `CommitOptimizer`: gradients averaged over the participants (one flat all-reduce through the
  Manager, ended at once when another group of the quorum fails: `replica_abort.py`), the optimizer
  stepped only if ``manager.should_commit()``; a `SpikeGuard`'s vote (seven small integers) rides at
  the end of that all-reduce (`ReplicaCommit` is the loop's `StepVote`: ``callbacks/spike_groups.py``; in a group of
  several workers the vote is on values summed over the group first, `ReplicaCommit.group_sum`);
- `ReplicaCommit` (a callback): a committed step advances the Timestamp by the global batch's
  rows; an uncommitted one restores the Timestamp and schedulers, so the loader serves the same
  global batch again to the new quorum. Every row is trained once per epoch and the final
  Timestamp is an uninterrupted run's. Per quorum change (a `QuorumChange`) it tells the loop's
  callbacks (``Callback.on_quorum_change``, through the `Engine`), prints one line and sends the
  history entries (the lead group only: participating rank 0) straight to the run's history, since
  ``ray.train.report`` is a barrier across all workers that a missing group would block.

Storage checkpoints (``checkpoint=``): every group holds the same committed state, so one group saves
it, the lead: participating rank 0 of the step's quorum, i.e. the lowest group number in it
(`lead_saves`, set by `ReplicaCommit` once the `Checkpointer` is attached); a step its lead did not survive commits nowhere, and the next quorum's lowest group
saves from then on (reloading the folder's index first: `lead_saves`); a save point whose checkpoint the dead lead had
not committed (it died writing it) is saved once, late, by the next lead at its first committed step (`lead_saves`,
`core/save_points.py`). A checkpoint is a plain one (world
size 1): it loads into a `Trainer` or resumes a `RayTrainer` run. Storage is read only at a start of the whole
run, after the first quorum (`load_at_first_quorum`): a group replaced while the others train heals from a
peer and reads nothing. A start of the whole run inside one fit (every group lost: the feeder, made on the
driver, lives on) resumes at the checkpoint's position, older than the feeder's pass: the groups' start there
opens the epoch's pass again at that batch (`EpochFeeder.start_epoch`), so the rows after it are trained once.

Cost per step: one Lighthouse quorum round trip (a small RPC, constant in groups) and one
all-reduce of the gradients across groups; per rejoin, one transfer of the state from a peer
(model + optimizer bytes over gloo). Every group fetches the whole global batch's blocks (k x
the data reads of plain DDP, local object-store reads on one node).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from raytrain_events.callbacks.spike_bisect import device_of, sum_over_ranks
from raytrain_events.callbacks.spike_guard import SpikeGuard
from raytrain_events.checkpoint.folder.store import latest_checkpoint
from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
from raytrain_events.checkpoint.run.preemption import SAVE_FLAG
from raytrain_events.core.callback import Callback, QuorumChange
from raytrain_events.core.interval import is_done
from raytrain_events.core.save_points import SavePoints
from raytrain_events.core.spikes import Skipped
from raytrain_events.core.time import Timestamp, counters_of
from raytrain_events.ray.checkpointing.validation import LATE_KEY, VALIDATE_KEY
from raytrain_events.ray.replica_checks import refuse_group_callbacks
from raytrain_events.ray.reports.aggregate import reduce_metrics

if TYPE_CHECKING:
    from raytrain_events.ray.replica_abort import CollectiveWatch

__all__ = ["build_manager", "CommitOptimizer", "ReplicaCommit", "ReplicaState", "QuorumChange"]

log = logging.getLogger(__name__)


class ReplicaState:
    """What a joining group receives from a healthy peer: filled in by the worker before the first step."""

    def __init__(self) -> None:
        self.state: Any = None  # the loop's State
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Any = None  # the inner torch optimizer
        self.schedulers: List[Any] = []
        self.healed = 0  # states received from a peer (the tests count them)

    def state_dict(self) -> Dict[str, Any]:
        assert self.model is not None and self.state is not None
        sd = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "timestamp": self.state.timestamp.state_dict(),
            "rng": torch.get_rng_state(),
        }
        guards = self._guards()
        if guards:  # the run's skip list and skipped counts: a joining group then saves and reports the same
            sd["skipped"] = self.state.skipped.state_dict()
            sd["spike_guards"] = [g.state_dict() for g in guards]
        return sd

    def _guards(self) -> List[SpikeGuard]:
        return [c for c in getattr(self.state, "callbacks", ()) if isinstance(c, SpikeGuard)]

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        assert self.model is not None and self.state is not None
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.load_loop_state(sd)
        log.info("Recovered from a healthy replica group at %s", self.state.timestamp)

    def load_loop_state(self, sd: Dict[str, Any]) -> None:
        """What the peer sent besides the model and optimizer: schedulers, Timestamp, RNG, and a `SpikeGuard`'s
        skip list, rollbacks and detector with `State.skipped` (a group of several workers: each position's, the
        same in every position)."""
        assert self.state is not None
        for scheduler, s in zip(self.schedulers, sd["schedulers"]):
            scheduler.load_state_dict(s)
        self.state.timestamp = Timestamp.from_state_dict(sd["timestamp"])
        torch.set_rng_state(sd["rng"])
        if "skipped" in sd:
            self.state.skipped = Skipped.from_state_dict(sd["skipped"])
        for guard, guard_state in zip(self._guards(), sd.get("spike_guards", [])):
            guard.load_state_dict(guard_state)  # its skip list and rollbacks (its snapshots: taken after the heal)
        self.healed += 1


def build_manager(  # noqa: PLR0913 (the group's numbers, handed over once)
    replicas: ReplicaState,
    group: int,
    run_name: str,
    min_replicas: int,
    timeout_s: float = 30.0,
    position: int = 0,
    group_size: int = 1,
) -> Tuple[Any, CollectiveWatch]:
    """This group's torchft ``Manager`` (the Lighthouse address comes from Ray: ``TORCHFT_LIGHTHOUSE``) and the
    `CollectiveWatch` that ends its all-reduce when another group of the quorum fails (`replica_abort.py`).

    ``timeout_s`` (`RunSpec.replica_timeout_s`): gloo's and the state transfer's limit, the quorum's
    twice that; 30 s re-forms the group on a loaded machine. A failed peer costs the others the heartbeat
    detection, not this limit (`replica_abort.py`). ``position``/``group_size``: this worker's rank in its group
    and the group's workers (`ReplicaLayout`; the Manager's ``rank``/``world_size``): its torchft process group is
    the same position's in every group, and the group's rank 0 talks to the Lighthouse for all of it."""
    from torchft import Manager  # torchft is the [ft] extra's: imported where a group is built
    from torchft.checkpointing.pg_transport import PGTransport

    # why here: defers torchft until this runs
    from raytrain_events.ray.replica_abort import AbortableGloo, CollectiveWatch  # torchft's subclass

    timeout = datetime.timedelta(seconds=timeout_s)
    pg = AbortableGloo(timeout=timeout)
    name = f"{run_name}_group{group:05d}"  # the Lighthouse orders groups by id: as numbers
    manager = Manager(
        pg=pg,
        min_replica_size=min_replicas,
        load_state_dict=replicas.load_state_dict,
        state_dict=replicas.state_dict,
        use_async_quorum=False,  # the quorum (and a heal) ends before the loader picks the rows
        world_size=group_size,
        rank=position,
        replica_id=name,
        timeout=2 * timeout,
        quorum_timeout=2 * timeout,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    return manager, CollectiveWatch(pg, f"{name}/{position}")


class CommitOptimizer(torch.optim.Optimizer):
    """An optimizer stepped only when torchft commits the step; gradients averaged over the groups.

    torchft's ``OptimizerWrapper`` with two changes: ``zero_grad`` starts no quorum (`ReplicaLoader`
    ran it before the batch was chosen) and ``step`` first averages the gradients over the
    participants (what torchft's DDP wrapper does per bucket, here one flat all-reduce).
    """

    def __init__(self, manager: Any, optimizer: torch.optim.Optimizer, watch: CollectiveWatch) -> None:  # noqa: D107
        # No super().__init__: the wrapped optimizer holds the parameters and state (as torchft's wrapper).
        self.manager = manager
        self.watch = watch
        self.optim = optimizer
        self.committed = False
        # What `ReplicaCommit.carry` adds to each step's all-reduce (a `SpikeGuard`'s vote), and its sums.
        self.vote: Optional[Callable[[], List[int]]] = None
        self.vote_sums: List[int] = []
        self.participants = 0

    @property  # type: ignore[override]
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optim.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for group in self.optim.param_groups for p in group["params"] if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # This worker's part of each gradient: the whole one, or its shard under FSDP (a DTensor's local tensor).
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        votes = self.vote() if self.vote is not None else []
        if grads or votes:  # one flat all-reduce (the Manager averages over the participants; errors -> no commit)
            parts = [g.reshape(-1) for g in grads]
            if votes:  # the votes ride at the end, as floats (exact: small integers, see `core/spikes.group_vote`)
                dtype = parts[0].dtype if parts else torch.float32
                if dtype not in (torch.float32, torch.float64):
                    raise ValueError(
                        f"replica groups: a SpikeGuard's vote rides on the gradient all-reduce, which is {dtype} here "
                        "and would round it. Fix: keep the parameters in float32 (precision='bf16' autocasts them)."
                    )
                parts.append(torch.tensor(votes, dtype=dtype, device=parts[0].device if parts else "cpu"))
            flat = torch.cat(parts)
            self.watch.allreduce(self.manager, flat)  # a failed peer ends it at once (replica_abort.py)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if votes:  # averaged over the participants: back to the integer sums
                self.participants = n = int(self.manager.num_participants())
                self.vote_sums = [round(v * n) for v in flat[offset:].tolist()]
        self.committed = bool(self.manager.should_commit())
        if self.committed:
            self.optim.step()


class ReplicaCommit(Callback):
    """Advance the Timestamp by the global batch only for committed steps; report from the lead group."""

    def __init__(  # noqa: D107, PLR0913
        self,
        loader: Any,  # this group's `ReplicaLoader` (replica_loader.py imports ReplicaState from here)
        optimizer: CommitOptimizer,
        history: Any = None,
        group: int = 0,
        load: Any = None,
        validation: Any = None,
    ) -> None:
        self.loader = loader
        self.validation = validation  # the run's `AsyncValidation` (None: in-loop eval only)
        self.optimizer = optimizer
        self.history = history  # the run's `RunHistory` actor: the lead group's entries go there directly
        self.group = group
        self.load = load  # the run's `CheckpointConfig` with its autoresume/load_from (`load_at_first_quorum`)
        self._before: Optional[Timestamp] = None
        self._schedulers: List[Any] = []
        self.changes: List[QuorumChange] = []
        self.attempt_started = time.time()
        self.first_report = True
        self._loop: Any = None  # (state, logger) of the loop, from INIT: callbacks hear quorum changes
        # Another group led a committed step since this one last saved (or started): see `lead_saves`.
        self.followed = True
        self.save_points = SavePoints()  # the save points another group led (`lead_saves`)
        self.take_over: Callable[[], None] = lambda: None  # see `lead_saves`
        loader.on_change = self._quorum_change

    def init(self, state, logger) -> None:
        # What a callbacks(config) factory built (instances: on the driver).
        refuse_group_callbacks(state.callbacks)
        self.loader.replicas.state = state
        self._loop = (state, logger)

    def after_load(self, state, logger) -> None:
        """The `Checkpointer` exists now (attached after INIT): one saver, the lead group; storage read only at a
        start of the whole run."""
        lead_saves(state, self)
        if self.load is not None:
            load_at_first_quorum(state, self, self.load)

    def after_dataloader(self, state, logger) -> None:
        """After this step's quorum (the loader's): a group that leads now after following checks the save points
        the old lead had (`lead_saves`); a late save asked for here is agreed by this batch's collective."""
        if self.save_points.pending and self.loader.manager.participating_rank() == 0:
            self.take_over()

    def batch_start(self, state, logger) -> None:
        self._before = state.timestamp
        self._schedulers = [s.state_dict() for s in state.schedulers]

    def batch_end(self, state, logger) -> None:
        before = self._before
        assert before is not None
        if self.optimizer.committed:
            if self.loader.manager.participating_rank() != 0:
                self.followed = True
            wct = state.timestamp.total_wct - before.total_wct
            state.timestamp = before.to_next_batch(self.loader.global_rows, 0, wct)
            state.batch_num_samples = state.global_batch_num_samples = self.loader.global_rows
        else:  # trained again with the next quorum: nothing of this step counts
            state.timestamp = before
            state.batch_num_samples = state.global_batch_num_samples = 0
            for scheduler, saved in zip(state.schedulers, self._schedulers):
                scheduler.load_state_dict(saved)
            log.warning("replica groups: the step at batch %s did not commit; training it again", int(before.batch))

    def carry(self, vote: Callable[[], List[int]]) -> None:
        """`StepVote`: ``vote()`` rides at the end of every step's gradient all-reduce (`CommitOptimizer.step`)."""
        self.optimizer.vote = vote

    def vote_sums(self) -> Optional[Tuple[List[int], int]]:
        """`StepVote`: the latest step's votes summed over its participants, and how many; None if it did not commit."""
        optimizer = self.optimizer
        return (optimizer.vote_sums, optimizer.participants) if optimizer.committed else None

    def group_sum(self, values: List[float]) -> List[float]:
        """`StepVote`: ``values`` summed over this group's workers (its own process group, the default one on its
        workers; no collective in a group of one)."""
        if self.loader.group_size == 1:
            return list(values)
        return sum_over_ranks(values, device_of(self.loader.replicas.state))

    def _quorum_change(self, change: QuorumChange) -> None:
        self.changes.append(change)
        if self.leads():
            log.warning(change.line())  # the run's console: one line per change, from the lead group
        self.send({"quorum_change": change.after - change.before, "replica_groups": change.after})
        if self._loop is not None:
            state, logger = self._loop
            for callback in state.callbacks:  # every callback's on_quorum_change (as `Engine.run_quorum_change`)
                callback.on_quorum_change(state, logger, change)

    def leads(self) -> bool:
        """Whether this worker speaks for the run: the lead group's (participating rank 0) first worker."""
        return self.loader.manager.participating_rank() in (0, None) and self.loader.group_position == 0

    def send(self, entry: Dict[str, Any]) -> None:
        """Add a history entry (lead group only), stamped with the global Timestamp and the time."""
        if self.history is None or not self.leads():
            return
        state = self.loader.replicas.state
        out = {f"time/{k}": v for k, v in counters_of(state.timestamp).items()}
        out.update(entry)
        out["wall_time"] = time.time()
        out["world_size"] = self.loader.participants
        self.history.add.remote(out)

    def report(self, report: Dict[str, Any], checkpoint: Any) -> None:
        """`RayReporter`'s ``report_fn``: this group's report as a history entry (see the module doc). A report
        after the lead's save names its checkpoint (``checkpoint_path``, as Ray Train's entries do: no scheme), so
        the entry's metrics (an eval at that batch's included) are the checkpoint's, at its Timestamp."""

        entry: Dict[str, Any] = dict(reduce_metrics([report]))
        if checkpoint is not None:
            entry["checkpoint_path"] = checkpoint.url.split("://", 1)[-1]
            if checkpoint.late_for:  # the history marks the lost checkpoints' entries (`RunHistory.add`)
                entry[LATE_KEY] = list(checkpoint.late_for)
            if self.validation is not None:  # the run's history starts the chosen ones' validation (Ray never sees it)
                entry[VALIDATE_KEY] = True
        entry["attempt"] = 1
        entry["final"] = bool(report.get("final", False))
        if self.first_report:
            entry["attempt_started_at"] = self.attempt_started
            self.first_report = False
        self.send(entry)


def load_at_first_quorum(state: Any, commit: ReplicaCommit, worker: Any) -> None:
    """Load the storage checkpoint (``worker``'s ``autoresume``/``load_from``) only at a start of the whole run.

    After this process's first quorum: if no group of it has committed a step yet (the quorum's step is 0: every
    group starts together, or all were lost), every group loads the same checkpoint, as a plain run does. If the
    others are training, the quorum has just healed this group from a live peer, whose state is newer than any
    checkpoint: reading one (the whole model and optimizer, from object storage) would be thrown away. A group
    replaced after the others finished the run (their final checkpoint is the newest: one index and one manifest
    read at each group's start) loads it at once, as no quorum will come."""

    checkpointer = find_checkpointer(state)
    if checkpointer is None or not (worker.autoresume or worker.load_from):
        return
    if worker.autoresume and _run_finished(state, worker):
        checkpointer.load(worker)  # replaced after the others finished: no quorum will come; end where the run did
        return
    commit.loader.start_load = lambda: checkpointer.load(worker)


def _run_finished(state: Any, worker: Any) -> bool:
    """Whether the newest checkpoint of the run's folder is at ``max_duration`` (its index and one manifest read)."""

    info = latest_checkpoint(worker.save_folder, storage_options=worker.storage_options)
    if info is None:
        return False
    now = state.timestamp
    try:
        names = ("epoch", "batch", "sample", "token")
        state.timestamp = Timestamp(**{k: int(v) for k, v in info.timestamp.items() if k in names})
        return is_done(state)
    finally:
        state.timestamp = now


def lead_saves(state: Any, commit: ReplicaCommit) -> None:
    """Only the lead group saves, and only a committed state: the group of participating rank 0 in the step's
    quorum (the lowest group number there), after a step that committed. When the lead dies, its step does
    not commit and the next quorum's lowest group leads from the next step on. A group that saves after another
    group led a committed step reloads the folder's index first (`CheckpointFolder.reload`): its own copy lacks
    the other's checkpoints, which ``keep`` would then never delete.

    A lead that dies after its step committed but before its checkpoint did (the upload in flight) leaves that
    save point without a checkpoint, and every other group is past it: each group notes the save points another
    group led (`SavePoints.passed`), and the group that leads next, at the first step it leads, reads the folder's
    index (the reload above, made earlier: one GET and one LIST per change of lead) and saves once, late, for the
    save points no committed checkpoint covers (`Checkpointer.save_late`: at that step if it commits, else at the
    next that does; its manifest's ``late_for`` names them). Its commit deletes the dead lead's half-written
    directory, an uncommitted one below it (`CheckpointFolder.committed`). Only the group's first worker reads the
    index and asks; the save is agreed by the group's per-batch collective, so all its workers save."""

    checkpointer = find_checkpointer(state)
    if checkpointer is None:
        return
    manager, optimizer, points = commit.loader.manager, commit.optimizer, commit.save_points

    def saves_here() -> bool:
        if not optimizer.committed:
            return False
        if manager.participating_rank() != 0:
            if checkpointer.late is not None:  # led no more before its late save: checked again when it leads
                points.led_elsewhere[:0] = list(checkpointer.late.missed)
                checkpointer.late = None
            points.passed(int(state.timestamp.batch))  # the lead saves it (`take_over` checks it did)
            state.agreement.clear(SAVE_FLAG)  # a request of this group's (its clock, a late save) is the lead's
            return False
        if commit.followed:
            checkpointer.checkpoints.reload()
            commit.followed = False
        return True

    def take_over() -> None:
        if commit.loader.group_position != 0:  # the group's first worker asks; the batch's collective agrees
            points.take_missed(None)
            return
        checkpointer.checkpoints.reload()  # the old lead's commits (and its half-written directory) in view
        commit.followed = False
        newest = checkpointer.checkpoints.index.newest()
        late = points.take_missed(None if newest is None else newest.batch)
        if late is not None:
            log.warning(
                "replica groups: the previous lead did not commit the checkpoint of save point(s) %s before it "
                "left; this group saves once at its next committed step, recorded as a late save",
                list(late.missed),
            )
            checkpointer.save_late(late)

    checkpointer.saves_here = saves_here
    commit.take_over = take_over
