"""`Checkpointer`: saves the run at checkpoint events and restores it at start-up.

It is a `Callback` placed first, so reporters running at the same event see the save.
Saving: the training thread captures the RNG state and copies the `State` into reusable host
buffers (``staging.py``) -- no collective, no storage I/O (ranks name the directory alike from a
token agreed at set-up, ``save_channel.py``). Everything else runs on the background save, whose
collectives use their own process group: every rank's RNG state is gathered to rank 0, which
uploads the state and every rank's RNG file, commits the manifest, updates the folder's index
and prunes (`Committer`).
One save is in flight at a time; a save that comes due meanwhile is postponed to the first
batch after it finished (training never waits on storage). Loading (`loading.py`, the `CheckpointLoader` it holds) happens between INIT and
AFTER_LOAD: ``autoresume`` takes the newest valid checkpoint of ``save_folder``, chosen by rank 0
and shared; otherwise ``load_from``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.dcp.sharded import DCP_LAYOUT, ShardedCheckpointIO
from raytrain_events.checkpoint.folder.committer import Committer
from raytrain_events.checkpoint.folder.folder import CheckpointFolder, LocalRetention
from raytrain_events.checkpoint.folder.local_tier import LocalTier
from raytrain_events.checkpoint.folder.retention import local_keep
from raytrain_events.checkpoint.folder.store import AsyncCheckpointWriter, DoneFuture
from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.checkpoint.format.manifest import CheckpointInfo, FileEntry
from raytrain_events.checkpoint.format.writer import CheckpointSave, new_checkpoint_url, rng_file_name
from raytrain_events.checkpoint.host import CheckpointHost
from raytrain_events.checkpoint.run.loading import CheckpointLoader, Restored, epoch_and_batch
from raytrain_events.checkpoint.run.preemption import SAVE_FLAG, save_on_sigterm
from raytrain_events.checkpoint.run.rng import capture_rng_state
from raytrain_events.checkpoint.run.save_channel import SaveChannel
from raytrain_events.checkpoint.run.staging import Staged
from raytrain_events.core.callback import Callback
from raytrain_events.core.event import Event
from raytrain_events.core.interval import make_interval
from raytrain_events.core.save_points import LateSave
from raytrain_events.core.time import TimeUnit, counters_of
from raytrain_events.storage.fs import basename, refuse_file_folder
from raytrain_events.storage.location import Location
from raytrain_events.storage.locks import acquire_lock, release_lock
from raytrain_events.storage.run_dir import STATE_FILE, RunDir

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from raytrain_events.core.state import State

__all__ = [
    "Checkpointer",
    "CheckpointHost",
    "SavedCheckpoint",
    "attach_checkpointing",
    "find_checkpointer",
    "STATE_FILE",
]

_BUSY_FLAG = "checkpoint_in_flight"  # some rank's previous save has not finished (see `_save_unless_busy`)


@dataclass
class SavedCheckpoint:
    """A save in progress or done: its URL, and ``wait()`` until it is committed."""

    url: str
    name: str
    rank: int
    writer: Optional[AsyncCheckpointWriter]
    future: Any = None
    folder: Optional[CheckpointFolder] = None  # rank 0: the folder it commits into (Ray registration tells it)
    late_for: Tuple[int, ...] = ()  # a late save: the batches of the save points it stands in for (`save_late`)

    def wait(self) -> Optional[CheckpointInfo]:
        """Block until committed (rank 0) and return its info; other ranks return None."""
        return None if self.future is None else self.future.result()


class Checkpointer(Callback):
    """Saves and loads checkpoints for one `Trainer` according to a `CheckpointConfig` (loading: the
    `CheckpointLoader` it builds and holds, ``loading.py``).

    Other components ask for a save with ``state.request("save")`` (on any rank); the ranks
    agree on it through the loop's per-batch collective and every rank saves at that batch.
    """

    def __init__(self, host: CheckpointHost, config: CheckpointConfig) -> None:
        self.keep = local_keep(config)
        self.host = host
        self.config = config
        state = host.state
        state.agreement.register(SAVE_FLAG)
        state.agreement.register(_BUSY_FLAG)
        self.options = dict(config.storage_options)
        self.run = _run_dir(config, state.run_name, self.options)
        self.folder = self.run.checkpoints if config.save_folder is None else config.save_folder
        self.run_dir = self.run.url
        self._interval = _save_interval(host, config)
        self._writer = AsyncCheckpointWriter(keep_going=True) if config.async_save else None
        self.sharded = _saves_sharded(host, config)
        # Directory names without a per-save collective; the background saves' own process group.
        self.channel = SaveChannel(host.dist, background=config.async_save)
        self._sharded_io: Optional[ShardedCheckpointIO] = None
        if self.sharded:
            self._sharded_io = ShardedCheckpointIO(host, self.options, own_group=False, group=self.channel.group)
        self._last_save_time = time.monotonic()
        # (epoch, batch) of the newest save or load (a checkpoint's Timestamp is the loop's at the save).
        self._last_saved: Optional[Tuple[int, int]] = None
        self._sigterm = contextlib.ExitStack()
        self._epoch_start_rng: Dict[str, Any] = capture_rng_state()
        self.saved: List[SavedCheckpoint] = []
        # The newest save no reporter has taken yet (see `take_unreported`).
        self._unreported: Optional[SavedCheckpoint] = None
        # Mid-epoch resume: (RNG state at the epoch's start, RNG state at the checkpoint).
        self._resume_rng: Optional[Tuple[Any, Any]] = None
        self.loaded: Optional[CheckpointInfo] = None
        self.loaded_local: Optional[LocalCopies] = None  # the local tier's record of the load: which tier served what
        self.loaded_safetensors: Optional[str] = None  # load_from was a safetensors directory (weights only)
        # Loading into a Trainer built for eval()/predict() only (see `load_for_inference`).
        self.inference = False
        # The folder's index and every deletion in it; retention is local unless Ray takes it over
        # (`CheckpointFolder.retain_with_ray`, ray/checkpointing/checkpointing.py).
        self.checkpoints = CheckpointFolder(self.folder, self.options, LocalRetention(self.keep))
        self.committer = Committer(self.checkpoints, deadline_s=config.upload_deadline_s, run=self.run)
        # Node-local copies of this process's files of each save, read first on a restart (folder/local_tier.py).
        self.local_tier = LocalTier(config.local_dir, self.folder, config.local_keep) if config.local_dir else None
        self.loader = CheckpointLoader(
            host,
            options=self.options,
            checkpoints=self.checkpoints,
            local_tier=self.local_tier,
            sharded_io=self._sharded_io,
            strict=config.load_strict,
            announce=config.announce_config_change,
        )
        self._deferred = False  # a save came due while the previous one was still in flight
        self._said_postponed = 0  # 1: a postponed save was said (INFO); 2: a skipped interval was warned of
        self.failures: List[Tuple[str, str]] = []  # (checkpoint URL, error) of saves that failed for good
        # Whether this process saves now: always, except under replica groups, where one group (the lead of the
        # step's quorum) saves the committed state for all (`ray/replica_groups.lead_saves`).
        self.saves_here: Callable[[], bool] = lambda: True
        self.late: Optional[LateSave] = None  # the next save stands in for save points a dead lead missed
        self._lock = self._claim_run_dir() if state.rank == 0 else None

    def _claim_run_dir(self) -> Any:
        """Rank 0: refuse a checkpoint folder that is a file, and take the run directory's lock (``lock_run_dir``):
        `RunLockedError`, naming the holder, when another live run holds it."""
        refuse_file_folder(self.folder, self.options)
        if not self.config.lock_run_dir:
            return None
        return acquire_lock(self.run_dir, "running", storage_options=self.options, takeover_stale=True)

    # ------------------------------------------------------------------ load
    def load(self, config: Optional[CheckpointConfig] = None) -> Optional[CheckpointInfo]:
        """Restore from ``autoresume`` (newest valid) or ``load_from`` (`CheckpointLoader.load`) and record it; None
        if nothing to load (or ``load_from`` was a safetensors directory: weights only, see ``loaded_safetensors``).
        ``config``: whose ``autoresume``/``load_from`` to follow (default this checkpointer's; replica groups load
        later, see `ray/replica_groups.load_at_first_quorum`)."""
        restored = self.loader.load(config or self.config, inference=self.inference)
        if isinstance(restored, str):  # a safetensors directory: the model's weights only
            self.loaded_safetensors = restored
        if not isinstance(restored, Restored):
            return None
        self.loaded, self.loaded_local = restored.info, restored.local
        self._last_saved = epoch_and_batch(self.host.state)
        if restored.rng is not None and self.host.state.timestamp.batch_in_epoch.value > 0:
            self._resume_rng = (restored.rng["epoch_start"], restored.rng["now"])
            self._epoch_start_rng = restored.rng["epoch_start"]
        return restored.info

    # ------------------------------------------------------------------ save
    def fit_start(self, state, logger) -> None:
        if self.config.save_on_sigterm:
            self._sigterm.enter_context(save_on_sigterm(state))

    def take_resume_rng(self) -> Optional[Tuple[Any, Any]]:
        """Once after a mid-epoch load: (RNG state at that epoch's start, RNG state at the save).

        The loop restores the first before it iterates the data again (a shuffling sampler draws
        from it), skips the batches already trained, then restores the second.
        """
        resume, self._resume_rng = self._resume_rng, None
        return resume

    def has_unreported(self) -> bool:
        """True if a save happened since the last `take_unreported`."""
        return self._unreported is not None

    @property
    def postponed(self) -> bool:
        """A save came due while the previous one was still uploading and waits for it (`_save_unless_busy`);
        the same on every rank (the ranks agree on the busy flag). A reporter waits for it (`RayReporter`)."""
        return self._deferred

    def uploading(self, state: State) -> bool:
        """Some rank's save was still in flight at this batch (agreed by its collective, as `postponed` is): a
        report now would queue behind that save's registration with Ray (`RayReporter._send`)."""
        return state.agreed(_BUSY_FLAG)

    def take_unreported(self) -> Optional[SavedCheckpoint]:
        """The newest save since the last call (None if none): what a reporter sends with its report."""
        saved, self._unreported = self._unreported, None
        return saved

    def epoch_start(self, state, logger) -> None:
        if self._resume_rng is None:  # a resumed epoch keeps the RNG state of its real start
            self._epoch_start_rng = capture_rng_state()

    def after_dataloader(self, state, logger) -> None:
        if self._writer is not None and self._writer.busy:  # agreed by this batch's collective, like SAVE_FLAG
            state.request(_BUSY_FLAG)
        else:
            state.agreement.clear(_BUSY_FLAG)
        seconds = self.config.save_every_n_seconds
        if seconds is not None and time.monotonic() - self._last_save_time >= seconds:
            state.request(SAVE_FLAG)  # agreed across ranks by this batch's collective

    def batch_checkpoint(self, state, logger) -> None:
        steps = self.config.save_every_n_steps
        due = state.agreed(SAVE_FLAG) or (steps is not None and state.step % steps == 0)
        if not due and self._interval is not None and self.config.save_interval.unit != TimeUnit.EPOCH:
            due = self._interval(state, Event.BATCH_END)
        if (due or self._deferred) and not (self.config.save_final and _ends_the_fit(state)):
            self._save_unless_busy(state, due)  # at the fit's last batch the end's save takes it, the epoch counted

    def epoch_checkpoint(self, state, logger) -> None:
        if self._interval is not None and self.config.save_interval.unit == TimeUnit.EPOCH:
            if self._interval(state, Event.EPOCH_END):
                self._save_unless_busy(state, True)

    def _save_unless_busy(self, state: State, due: bool) -> None:
        """Save now, or, while some rank's previous save is still in flight, at the first batch after
        it finished: a slow store delays the next save, never training.

        A save postponed by a few batches (a loaded machine) is said at INFO. A save that comes due
        while the one before it is still postponed means storage takes longer than the whole save
        interval: a warning, once per run. Both from rank 0 alone: the ranks agree on the busy flag,
        so every rank knows the same (one line, not one per worker)."""
        if state.agreed(_BUSY_FLAG):
            # 1: the first postponement (INFO); 2: a save due while the previous due one still waits (WARNING)
            said = 1 if not self._deferred else 2 if due else 0
            if said and state.rank == 0 and self._said_postponed < said:
                self._said_postponed = said
                level = logging.INFO if said == 1 else logging.WARNING
                _log.log(
                    level,
                    "Checkpoint save due at batch %d is postponed to the first batch after the previous save "
                    "finished uploading (training does not wait)%s",
                    state.timestamp.get_value(TimeUnit.BATCH),
                    "."
                    if level == logging.INFO
                    else ", and the one before it still waits: storage takes longer than the save interval, "
                    "so checkpoints are further apart than asked. Said once per run.",
                )
            self._deferred = True
            return
        self._deferred = False
        self.save()

    def fit_end(self, state, logger) -> None:
        # A save asked for at the last batch (SIGTERM) is not agreed by any later batch: save anyway.
        if self.config.save_final or state.agreement.requested(SAVE_FLAG):
            self.save()

    def save_late(self, late: LateSave) -> None:
        """Save at the next batch this process saves at (a committed one under replica groups), recorded in the
        manifest's metadata (``late_for``) as standing in for ``late.missed`` (their lead died before committing)."""
        self.late = late
        self.host.state.request(SAVE_FLAG)

    def save(self) -> Optional[SavedCheckpoint]:
        """Save now (every rank must call this at the same batch); None if this batch is saved."""
        host, state, dist = self.host, self.host.state, self.host.dist
        if epoch_and_batch(state) == self._last_saved or not self.saves_here():
            return None
        timestamp = counters_of(state.timestamp)
        url = new_checkpoint_url(self.folder, timestamp=timestamp, name=self.channel.name(timestamp))
        rng = {"now": capture_rng_state(), "epoch_start": self._epoch_start_rng}  # fresh copies
        metadata = {
            "config": host.config,
            "run_name": state.run_name,
            # Where the epoch's data order stands, in global samples (any world size resumes from it).
            "data_position": {
                "epoch": timestamp["epoch"],
                "batch_in_epoch": state.timestamp.batch_in_epoch.value,
                "sample_in_epoch": state.timestamp.sample_in_epoch.value,
                "seed": state.seed,
                "world_size": dist.world_size,
            },
            "checkpoint_config": self.config.to_dict(),
        }
        late, self.late = self.late, None
        if late is not None:
            metadata["late_for"] = list(late.missed)
        local = self.local_tier.for_save(basename(url)) if self.local_tier is not None else None
        save = CheckpointSave(Location.of(url, self.options), timestamp, dist.world_size, metadata, local)
        if self._sharded_io is not None:
            future = self._save_sharded(save, rng)
        else:
            payload: Optional[Dict[str, Any]] = None
            if state.rank == 0:
                payload = state.state_dict()
                payload["timestamp"] = state.timestamp.state_dict()
            staged = self.channel.stage(payload)  # the copy, all that blocks training
            job = lambda: self._write(save, staged.tree, rng, [])  # noqa: E731
            future = self._start(url, job, staged)
        self._last_saved = epoch_and_batch(state)
        self._last_save_time = time.monotonic()
        state.agreement.clear(SAVE_FLAG)
        saved = SavedCheckpoint(
            url=url,
            name=basename(url),
            rank=state.rank,
            writer=self._writer,
            future=future,
            folder=self.checkpoints if state.rank == 0 else None,
            late_for=late.missed if late is not None else (),
        )
        self.saved.append(saved)
        self._unreported = saved
        return saved

    def _save_sharded(self, save: CheckpointSave, rng: Dict[str, Any]) -> Any:
        """Every rank writes its shards (staged to host buffers first when async); rank 0 then commits."""
        io = self._sharded_io
        tensors, rest = io.snapshot()
        staged = self.channel.stage({"tensors": tensors, "rest": rest})  # the copy, all that blocks training
        tensors, rest = staged.tree["tensors"], staged.tree["rest"]
        save = save.with_metadata(layout=DCP_LAYOUT, parallelism=self.host.parallel.kind)

        def job() -> Optional[CheckpointInfo]:
            shards = io.write_shards(save.url, tensors, save.local)
            return self._write(save, rest, rng, shards)

        return self._start(save.url, job, staged)

    def _start(self, url: str, job: Callable[[], Any], staged: Staged) -> Any:
        """Run ``job`` in the background save (async) or now; the staged buffers are released after it."""

        def run() -> Any:
            try:
                done = job()
            finally:
                staged.release()
            if self.local_tier is not None:  # this node keeps the newest local_keep copies, like storage
                self.local_tier.saved()
            return done

        return self._writer.submit(self._reported(url, run)) if self._writer is not None else DoneFuture(run())

    def _write(
        self, save: CheckpointSave, snapshot: Optional[Dict[str, Any]], rng: Dict[str, Any], entries: List[FileEntry]
    ) -> Optional[CheckpointInfo]:
        """Every rank: gather the RNG states to rank 0 (a collective). Rank 0: upload the state and
        every rank's RNG file and commit them with ``entries`` (files other ranks wrote: their shards)
        (`Committer`); None on the other ranks."""
        rngs = self.channel.gather_rngs(rng)
        if self.host.state.rank != 0:
            return None
        files: Dict[str, Any] = {rng_file_name(r): one for r, one in sorted(rngs.items())}
        files[STATE_FILE] = snapshot
        return self.committer.commit(save, files, entries)

    def _reported(self, url: str, job: Callable[[], Any]) -> Callable[[], Any]:
        """A background save that, if it fails for good, says so on the console (an error log line),
        records it in ``failures`` and the folder's index (the run report lists it), and re-raises to
        its waiter (Ray's registration), not to training."""
        batch = self.host.state.timestamp.get_value(TimeUnit.BATCH)

        def run() -> Any:
            try:
                return job()
            except Exception as e:
                self.failures.append((url, f"{type(e).__name__}: {e}"))
                _log.error("Checkpoint save %s failed (training goes on; the next save tries again): %s", url, e)
                if self.host.state.rank == 0:  # listed in the index (for the run report) at its next write
                    self.checkpoints.record_failure(url, batch, f"{type(e).__name__}: {e}")
                raise

        return run

    def wait(self) -> None:
        """Block until the in-flight save is finished (a failed async save is in ``failures``)."""
        if self._writer is not None:
            self._writer.wait()

    def reopen(self) -> None:
        """Save again after `close` (a further ``Trainer.fit``): a new writer thread and the run-dir lock."""
        if self.config.async_save:
            self._writer = AsyncCheckpointWriter(keep_going=True)
        if self.config.lock_run_dir and self.host.state.rank == 0 and self._lock is None:
            self._lock = acquire_lock(self.run_dir, "running", storage_options=self.options, takeover_stale=True)

    def close(self, state=None, logger=None) -> None:
        """Finish the in-flight save and remove the SIGTERM handler."""
        self._sigterm.close()
        try:
            if self._writer is not None:
                self._writer.close()
            if self.host.state.rank == 0:
                self.checkpoints.flush()  # failed saves not yet written with a commit
        finally:
            if self._lock is not None:
                lock, self._lock = self._lock, None
                release_lock(self.run_dir, "running", storage_options=self.options, lock=lock)


def _run_dir(config: CheckpointConfig, run_name: str, options: Dict[str, Any]) -> RunDir:
    """The run directory: ``save_folder``'s parent, or a plain `Trainer`'s ``runs/<run_name>`` without one."""
    if config.save_folder is None:
        return RunDir(os.path.abspath(os.path.join("runs", run_name)), options)
    return RunDir.of_checkpoints(config.save_folder, options)


def _save_interval(host: CheckpointHost, config: CheckpointConfig) -> Any:
    """When periodic saves come due, or None. A 'tok' interval needs a token counter (as eval_interval does):
    else no periodic save would happen."""
    if config.save_interval is None:
        return None
    counts_tokens = getattr(getattr(host, "train_spec", None), "counts_tokens", True)
    return make_interval(
        config.save_interval, host.state.max_duration, counts_tokens=counts_tokens, what="save_interval"
    )


def _saves_sharded(host: CheckpointHost, config: CheckpointConfig) -> bool:
    """Whether saves are sharded (DCP): ``sharded``, else whenever the model is (FSDP across ranks); a sharded
    model cannot be saved whole."""
    model_sharded = host.parallel.sharded and host.dist.is_distributed
    if model_sharded and config.sharded is False:
        raise ValueError(
            "CheckpointConfig(sharded=False) with parallelism='fsdp': a sharded model is saved as shards (no "
            "rank holds the whole model). Fix: leave sharded=None; export one file with `raytrain-events export`."
        )
    return bool(config.sharded) if config.sharded is not None else model_sharded


def attach_checkpointing(host: CheckpointHost, config: CheckpointConfig) -> Checkpointer:
    """Load per ``config`` and register the saver as the first callback of ``host``'s state."""
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"checkpoint must be a CheckpointConfig, got {type(config).__name__}.")
    checkpointer = Checkpointer(host, config)
    try:
        checkpointer.load()
    except BaseException:
        checkpointer.close()  # release the run dir lock: nothing was trained
        raise
    host.state.callbacks.insert(0, checkpointer)
    host.engine.refresh()
    return checkpointer


def _ends_the_fit(state: State) -> bool:
    """Whether this batch, the last of its epoch, ends the fit once the epoch ends (the loop counts that epoch
    before the fit's end: a save here would record the epoch before the end, and the end-of-fit save, at the
    same batch, would be skipped)."""
    steps, duration = state.steps_per_epoch, state.max_duration
    if steps is None or duration is None or int(state.timestamp.batch_in_epoch) != steps:
        return False
    if duration.unit == TimeUnit.DURATION:
        return False
    return state.timestamp.to_next_epoch().get_value(duration.unit) >= duration.value


def find_checkpointer(state: State) -> Optional[Checkpointer]:
    """The `Checkpointer` among ``state.callbacks``, if the run saves checkpoints."""
    for callback in state.callbacks:
        if isinstance(callback, Checkpointer):
            return callback
    return None
