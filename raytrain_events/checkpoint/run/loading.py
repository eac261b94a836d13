"""Restoring a checkpoint into a run: the newest one chosen once and shared, then applied to the `State`.

`CheckpointLoader.load` (which the `Checkpointer` builds and holds) decides *what* to load (autoresume,
``load_from``, a safetensors directory); the functions below do the reading and restoring. Rank 0 alone lists the folder and reads the manifest
(O(1) storage requests per resume, whatever the number of ranks); every rank then reads the
chosen checkpoint's files. Applying handles full and sharded checkpoints into DDP or FSDP models,
partial starts (``load_ignore_keys``, weights only), loads for inference, and hands back the
saved RNG state so a mid-epoch resume replays the epoch's data order exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.dcp.safetensors_io import is_safetensors_dir, start_from_safetensors
from raytrain_events.checkpoint.dcp.sharded import ShardedCheckpointIO, is_sharded_checkpoint, load_full_into_sharded
from raytrain_events.checkpoint.folder.store import load_latest_valid
from raytrain_events.checkpoint.format.manifest import CheckpointInfo, CheckpointNotCommittedError, LoadedCheckpoint
from raytrain_events.checkpoint.format.reader import read_checkpoint, read_checkpoint_files
from raytrain_events.checkpoint.format.writer import rng_file_name
from raytrain_events.checkpoint.run.peer_fill import fill_from_rank0
from raytrain_events.checkpoint.run.rng import restore_rng_state
from raytrain_events.core.interval import is_done
from raytrain_events.core.state import CheckpointMismatchError, drop_ignored_keys
from raytrain_events.core.time import Timestamp, counters_of
from raytrain_events.parallel.wrap import is_sharded_module
from raytrain_events.storage.config_diff import format_config_diff
from raytrain_events.storage.fs import refuse_file_folder
from raytrain_events.storage.run_dir import STATE_FILE  # re-exported (the name is the run layout's)

if TYPE_CHECKING:
    from raytrain_events.checkpoint.folder.folder import CheckpointFolder
    from raytrain_events.checkpoint.folder.index import CheckpointIndex
    from raytrain_events.checkpoint.folder.local_tier import LocalTier
    from raytrain_events.checkpoint.format.local_copy import LocalCopies
    from raytrain_events.checkpoint.host import CheckpointHost

_log = logging.getLogger(__name__)

__all__ = ["STATE_FILE", "CheckpointLoader", "Restored", "apply_checkpoint", "epoch_and_batch", "read_latest_shared"]


@dataclass(frozen=True)
class Restored:
    """What a load restored: the checkpoint's info, the node-local tier's record of which tier served each file
    (None without a local tier), and this rank's saved RNG state at the save and at its epoch's start (None when the
    load restores weights only, is for inference, or the checkpoint holds no RNG file for this rank)."""

    info: CheckpointInfo
    local: Optional[LocalCopies] = None
    rng: Optional[Dict[str, Any]] = None


class CheckpointLoader:
    """What to load at start-up, read and applied: the `Checkpointer` builds one with what it reads from (the run's
    checkpoint folder, its index and node-local tier, the sharded reader) and asks it to ``load``; the loader keeps
    nothing of the run's own (the `Checkpointer` records what was loaded)."""

    def __init__(  # noqa: PLR0913 (what a load reads from, each named)
        self,
        host: CheckpointHost,
        *,
        options: Dict[str, Any],
        checkpoints: CheckpointFolder,
        local_tier: Optional[LocalTier],
        sharded_io: Optional[ShardedCheckpointIO],
        strict: bool,
        announce: bool,
    ) -> None:
        self.host, self.options, self.checkpoints = host, options, checkpoints
        self.folder = checkpoints.url
        self.local_tier, self.sharded_io = local_tier, sharded_io
        self.strict, self.announce = strict, announce

    def load(self, config: CheckpointConfig, *, inference: bool = False) -> Union[Restored, str, None]:
        """Restore from ``config``'s ``autoresume`` (the folder's newest valid checkpoint) or ``load_from``: what was
        restored; ``load_from`` itself when it is a safetensors directory (weights only: an export, a Hugging Face
        model); None when there is nothing to load. ``inference``: into a model built for eval()/predict() only."""
        loaded: Optional[LoadedCheckpoint] = None
        if config.autoresume:
            loaded = self._read_latest(self.folder)
        ignore: Sequence[str] = ()
        weights_only = False  # resuming this run's own checkpoint restores everything
        if loaded is None and config.load_from and is_safetensors_dir(config.load_from, self.options):
            start_from_safetensors(self.host.state.model, config)
            return config.load_from
        if loaded is None and config.load_from:
            refuse_file_folder(config.load_from, self.options, what="load_from")  # e.g. .../state.pt
            loaded = self._read(config.load_from)
            if loaded is None:
                raise FileNotFoundError(
                    f"load_from={config.load_from!r} holds no committed checkpoint. Point it at a checkpoint "
                    "directory (one with manifest.json) or a folder of them."
                )
            ignore = config.load_ignore_keys  # a partial start; resuming this run's own checkpoints loads all
            weights_only = config.load_weights_only
        if loaded is None:
            return None
        return self._apply(loaded, ignore, weights_only, inference)

    def _read_latest(self, folder: str) -> Optional[LoadedCheckpoint]:
        """The newest valid checkpoint of ``folder``, chosen by rank 0 and shared (see `read_latest_shared`)."""
        index = self.checkpoints.index if folder == self.folder else None
        tier = self.local_tier if folder == self.folder else None
        return read_latest_shared(self.host, folder, self.options, index, tier)

    def _read(self, url: str) -> Optional[LoadedCheckpoint]:
        try:  # a checkpoint directory, else a folder of them
            return read_checkpoint(url, storage_options=self.options, files=[STATE_FILE], map_location="cpu")
        except CheckpointNotCommittedError:
            return self._read_latest(url)

    def _apply(self, loaded: LoadedCheckpoint, ignore: Sequence[str], weights_only: bool, inference: bool) -> Restored:
        local = self.local_tier.copies(loaded.info.name) if self.local_tier is not None else None
        rng = apply_checkpoint(
            self.host,
            loaded,
            self.options,
            strict=self.strict,
            sharded_io=self.sharded_io,
            inference=inference,
            ignore=ignore,
            weights_only=weights_only,
            local=local,
            announce=self.announce,
        )
        if local is not None:  # which tier served each file, on each rank (a warning when storage served some)
            log = _log.warning if local.storage else _log.info
            log("Rank %d loaded checkpoint %s: %s", self.host.state.rank, loaded.info.name, local.summary())
        return Restored(loaded.info, local, rng)


def epoch_and_batch(state: Any) -> Tuple[int, int]:
    """(epoch, batch) of ``state``'s Timestamp: the newest save's or load's (a checkpoint's Timestamp is the loop's)."""
    return int(state.timestamp.epoch), int(state.timestamp.batch)


def read_latest_shared(
    host: CheckpointHost,
    folder: str,
    options: Dict[str, Any],
    index: Optional[CheckpointIndex] = None,
    local_tier: Optional[LocalTier] = None,
) -> Optional[LoadedCheckpoint]:
    """The newest valid checkpoint of ``folder``, chosen once by rank 0 and shared with its
    manifest (no rank but rank 0 lists the folder or reads the manifest); every rank then reads
    that checkpoint's files. ``index``: the folder's checkpoint index, when this run keeps one.
    ``local_tier``: this node's copies, read where they match the manifest (else storage); a full checkpoint's
    ``state.pt``, which only rank 0's node keeps, is first sent by rank 0 to the ranks whose node lacks it
    (`fill_from_rank0`: a collective, one all-gather of flags, and the file's bytes only when one lacks it)."""
    dist, rank = host.dist, host.state.rank
    loaded: Optional[LoadedCheckpoint] = None
    choice: Any = None
    if rank == 0:
        try:
            loaded = load_latest_valid(
                folder, storage_options=options, files=[STATE_FILE], index=index, local_tier=local_tier
            )
            choice = None if loaded is None else loaded.info
        except Exception as e:
            if not dist.is_distributed:
                raise
            choice = e
    if dist.is_distributed:
        choice = dist.all_gather_object(choice if rank == 0 else None)[0]
    if isinstance(choice, Exception):
        raise choice
    if choice is None:
        return loaded
    local = local_tier.copies(choice.name) if local_tier is not None else None
    if local_tier is not None:  # a node without rank 0's state.pt gets it from rank 0, not storage (peer_fill.py)
        fill_from_rank0(dist, rank, choice, local)
    if rank == 0:
        return loaded
    return read_checkpoint_files(choice, storage_options=options, files=[STATE_FILE], map_location="cpu", local=local)


def apply_checkpoint(
    host: CheckpointHost,
    loaded: LoadedCheckpoint,
    options: Dict[str, Any],
    *,
    strict: bool,
    sharded_io: Optional[ShardedCheckpointIO],
    inference: bool = False,
    ignore: Sequence[str] = (),
    weights_only: bool = False,
    local: Optional[LocalCopies] = None,
    announce: bool = True,
) -> Optional[Dict[str, Any]]:
    """Restore ``loaded`` into ``host.state`` (``announce``: a changed config as a warning, else at INFO); returns this rank's saved RNG state (already restored
    to its value at the save; ``epoch_start`` is its value at that epoch's start), or None when the
    load restores weights only, is for inference, or the checkpoint holds no RNG file for this rank.
    ``local``: the node-local copy of its files, read where they match the manifest (else storage)."""
    state = host.state
    saved = loaded.files[STATE_FILE]
    ignored_model_keys: List[str] = []
    if ignore:
        if is_sharded_checkpoint(loaded.info) or is_sharded_module(state.model):
            raise ValueError(
                "load_ignore_keys works with full checkpoints into unsharded (DDP) models; for FSDP, load "
                "with load_strict=False, or export the checkpoint to one file first (`raytrain-events export`)."
            )
        saved, ignored_model_keys = drop_ignored_keys(saved, ignore, state.model.state_dict().keys())
    if inference:  # no optimizer or scheduler to restore, nor RNG state to take over
        saved = {k: v for k, v in saved.items() if k not in ("optimizers", "schedulers", "scaler")}
        sharded = is_sharded_checkpoint(loaded.info) or is_sharded_module(state.model)
        weights_only = weights_only or sharded  # a sharded load restores the optimizers with the model
    if not weights_only and not inference:
        check_manifest_timestamp(loaded.info, saved)
    if is_sharded_checkpoint(loaded.info):
        io = sharded_io or ShardedCheckpointIO(host, options, own_group=False)
        io.load(loaded.info, saved, strict=strict, weights_only=weights_only, local=local)
    elif is_sharded_module(state.model):  # a full (DDP) checkpoint into an FSDP model
        load_full_into_sharded(state, saved, strict=strict, weights_only=weights_only)
    elif weights_only:
        state.load_model_state(saved["model"], strict=strict, ignored=ignored_model_keys)
    else:
        state.load_state_dict(saved, strict=strict, ignored=ignored_model_keys)
    if weights_only or inference:
        return None
    _warn_config_changed(host, loaded, announce)
    if state.max_duration is not None and is_done(state) and state.rank == 0:
        _log.warning(
            "The checkpoint %s is at %s, already at or past max_duration=%s: fit() will train nothing. To train "
            "more, raise max_duration (or call fit(duration=...)); to start a new run from its weights, "
            "pass CheckpointConfig(load_weights_only=True).",
            loaded.info.url,
            counters_of(state.timestamp),
            state.max_duration.to_timestring(),
        )
    rng_name = rng_file_name(state.rank)
    if not any(f.name == rng_name for f in loaded.info.files):
        return None
    rng = read_checkpoint_files(loaded.info, storage_options=options, files=[rng_name], local=local).files[rng_name]
    restore_rng_state(rng["now"])
    return rng


def check_manifest_timestamp(info: Any, saved: Dict[str, Any]) -> None:
    """Refuse a checkpoint whose manifest's counters (what listings and resumes choose by) disagree with
    the state it holds (what would load): an edited or mixed-up checkpoint."""
    if "timestamp" not in saved or not info.timestamp:
        return
    held = counters_of(Timestamp.from_state_dict(saved["timestamp"]))
    differ = {k: (v, held[k]) for k, v in info.timestamp.items() if k in held and held[k] != v}
    if differ:
        raise CheckpointMismatchError(
            f"The checkpoint {info.url} is inconsistent: its manifest.json lists "
            f"{ {k: a for k, (a, _) in differ.items()} } but its state holds { {k: b for k, (_, b) in differ.items()} } "
            "(manifest.json was edited, or the files come from different saves). Fix: load another checkpoint "
            "(the one before it), or restore this one's manifest.json."
        )


def _warn_config_changed(host: CheckpointHost, loaded: LoadedCheckpoint, announce: bool) -> None:
    """Rank 0 logs a diff when the run resumes with a config other than the one saved (a warning when it
    ``announce``s it; at INFO where the driver already did: a Ray worker's line would break the progress bar)."""
    saved_config = loaded.info.metadata.get("config")
    if host.state.rank == 0 and saved_config is not None and host.config and saved_config != host.config:
        _log.log(
            logging.WARNING if announce else logging.INFO,
            "Resuming %s with a different config:\n%s",
            loaded.info.url,
            format_config_diff(saved_config, host.config),
        )
