"""`CheckpointConfig`: when to save, how many to keep, and what to load (Composer + ml-starter knobs).

Saving happens at ``BATCH_CHECKPOINT`` / ``EPOCH_CHECKPOINT`` when any trigger fires:
``save_interval`` (a `Time`: "1ep", "500ba", "1e6tok"), ``save_every_n_steps``, or
``save_every_n_seconds`` (default 3600, like ml-starter), plus once at the end of training
(``save_final``) and on SIGTERM (preemption) when ``save_on_sigterm`` is set.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Sequence, Union

from raytrain_events.core.time import Time, TimeUnit, ensure_time

__all__ = ["CheckpointConfig", "check_local_dir"]


@dataclass
class CheckpointConfig:
    """How a run saves and loads checkpoints.

    Example::

        CheckpointConfig(save_interval="1ep", keep=3, autoresume=True)

    Fields:
        save_folder: where checkpoints go (any fsspec URL); default ``<run dir>/checkpoints``.
        save_interval: save whenever the global Timestamp crosses a multiple of this `Time`.
        save_every_n_steps: save every N optimizer steps (ml-starter's knob).
        save_every_n_seconds: save when this many seconds passed since the last save.
        keep: how many committed checkpoints to keep (None keeps all).
        keep_best: keep the ``keep_best`` best checkpoints by ``metric`` plus the newest (which a
            resume needs); on Ray, Ray Train's checkpoint manager prunes the rest. Not with ``keep``.
        metric, mode: the metric (a history key, like ``"metrics/eval/accuracy"``) that ranks
            checkpoints for ``keep_best`` and `RayResult.best_checkpoint`, and ``"max"`` or ``"min"``.
        only_save_most_recent: shorthand for ``keep=1``.
        save_final: save once when training ends.
        save_on_sigterm: on SIGTERM (spot reclaim), save before the process exits.
        async_save: write files in a background thread; training is blocked only for the copy. One save
            is in flight at a time: a save that comes due while the previous one still uploads is
            taken at the first batch after it finished (a warning says so, once).
        upload_deadline_s: how long one save retries its uploads through transient storage errors
            (backoff 0.5 s doubling to 30 s, ``checkpoint/folder/retry.py``) before it fails for good; an
            async save that fails is logged and recorded, training goes on, the next save tries again.
        load_from: a checkpoint (or a folder of them) to start from, or a safetensors directory
            (``model.safetensors`` or its index: an export, a Hugging Face model) for the weights only.
        load_strict: refuse model keys that do not match exactly.
        load_weights_only: load only model weights (fresh optimizer, timestamp and RNG).
        load_ignore_keys: glob patterns of checkpoint entries not to load (a partial load, e.g. a new
            head): ``"model/head.*"`` (model parameters by name), ``"optimizers"``, ``"schedulers"``,
            ``"timestamp"``, ``"algorithms/EMA"``, ``"callbacks/<Name>"``. Ignored model keys may be
            missing or shaped differently; a pattern that matches nothing is refused (a typo).
        autoresume: continue from the newest valid checkpoint in ``save_folder`` if there is one.
        storage_options: fsspec options (endpoint URL, credentials) for ``save_folder``/``load_from``.
        sharded: write sharded checkpoints (torch.distributed.checkpoint: every rank writes its own
            shards, in parallel, no gather). None (default): sharded exactly when the model is
            (``parallelism="fsdp"``). Either kind loads into either strategy and rank count.
        lock_run_dir: hold the run directory's ``running`` lock while training, so a second run
            on it is refused. The run directory is the parent of a ``<run>/checkpoints`` folder;
            a ``save_folder`` named otherwise is its own run directory (`RunDir.of_checkpoints`). `RayTrainer` holds it on the
            driver instead and turns this off on its workers.
        local_dir: a node-local directory (NVMe, local SSD) where each save also keeps this node's ranks' files, so
            a whole-run restart on the same nodes reads local disk instead of object storage. Storage stays the
            truth: a local file is read only if its size and CRC32 match the committed manifest's, else (missing,
            corrupt, another node's rank) that file is read from storage. None: no local tier.
        local_keep: how many checkpoints' local copies each node keeps (default: ``keep``; 1 with ``keep_best``,
            as a restart reads the newest; all when neither is set, like storage).
        announce_config_change: log (a warning, rank 0) the config's differences when a resume loads
            a checkpoint saved with another config. `RayTrainer` announces them once on the driver,
            before its progress bar, and turns this off on its workers (they log it at INFO: Ray's files).
    """

    save_folder: Optional[str] = None
    save_interval: Optional[Union[str, Time]] = None
    save_every_n_steps: Optional[int] = None
    save_every_n_seconds: Optional[float] = 3600.0
    keep: Optional[int] = None
    keep_best: Optional[int] = None
    metric: Optional[str] = None
    mode: str = "max"
    only_save_most_recent: bool = False
    save_final: bool = True
    save_on_sigterm: bool = True
    async_save: bool = True
    upload_deadline_s: float = 600.0
    load_from: Optional[str] = None
    load_strict: bool = True
    load_weights_only: bool = False
    load_ignore_keys: Sequence[str] = ()
    autoresume: bool = False
    storage_options: Dict[str, Any] = field(default_factory=dict)
    lock_run_dir: bool = True
    announce_config_change: bool = True
    sharded: Optional[bool] = None
    local_dir: Optional[str] = None
    local_keep: Optional[int] = None

    def __post_init__(self) -> None:  # noqa: C901 -- one check per option, in field order (checkpoint/ owner)
        for name in ("save_every_n_steps", "keep", "keep_best", "local_keep"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}={value!r} must be an integer (or None), like {name}=3.")
        for name in ("save_every_n_seconds", "upload_deadline_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name}={value!r} must be a number of seconds, like {name}=600.")
        if self.load_from is not None and not isinstance(self.load_from, (str, os.PathLike)):
            raise TypeError(f"load_from={self.load_from!r} must be a checkpoint URL or path (a string).")
        if self.load_from is not None:
            self.load_from = os.fspath(self.load_from)
        if self.save_interval is not None:
            interval = ensure_time(self.save_interval, TimeUnit.EPOCH)
            if interval.unit == TimeUnit.DURATION or interval.value <= 0:
                raise ValueError(
                    f"save_interval={interval.to_timestring()!r}: give a positive 'ep', 'ba', 'sp' or 'tok' Time, like '1ep'."
                )
            self.save_interval = interval
        if isinstance(self.load_ignore_keys, str):
            self.load_ignore_keys = [self.load_ignore_keys]
        self.load_ignore_keys = list(self.load_ignore_keys)
        if not self.upload_deadline_s >= 0:
            raise ValueError(f"upload_deadline_s={self.upload_deadline_s} must be >= 0 (0: no retries).")
        if self.save_every_n_steps is not None and self.save_every_n_steps < 1:
            raise ValueError(f"save_every_n_steps={self.save_every_n_steps} must be >= 1 (or None).")
        if self.save_every_n_seconds is not None and self.save_every_n_seconds <= 0:
            raise ValueError(f"save_every_n_seconds={self.save_every_n_seconds} must be > 0 (or None).")
        if self.only_save_most_recent:
            if self.keep not in (None, 1):
                raise ValueError(
                    f"only_save_most_recent=True keeps 1 checkpoint, but keep={self.keep}: set one of them."
                )
            self.keep = 1
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep={self.keep} must be >= 1 (or None to keep every checkpoint).")
        if self.mode not in ("max", "min"):
            raise ValueError(f"mode={self.mode!r} must be 'max' (higher metric is better) or 'min'.")
        if self.keep_best is not None:
            if self.keep_best < 1:
                raise ValueError(f"keep_best={self.keep_best} must be >= 1 (or None).")
            if not self.metric:
                raise ValueError(
                    f"keep_best={self.keep_best} ranks checkpoints by a metric: pass metric=, like "
                    "metric='metrics/eval/accuracy', mode='max'."
                )
            if self.keep is not None:
                raise ValueError(
                    f"keep={self.keep} and keep_best={self.keep_best}: keep_best already keeps the newest "
                    "checkpoint besides the best ones; set only one."
                )

        self._check_local_tier()

    def _check_local_tier(self) -> None:
        """``local_dir``: a local path this process can write (checked again on each worker when it saves)."""
        if self.local_keep is not None and self.local_keep < 1:
            raise ValueError(f"local_keep={self.local_keep} must be >= 1 (or None: like keep).")
        if self.local_dir is None:
            return
        if not isinstance(self.local_dir, (str, os.PathLike)):
            raise TypeError(f"local_dir={self.local_dir!r} must be a local directory path (a string).")
        self.local_dir = check_local_dir(os.fspath(self.local_dir))
        if self.local_keep is None:
            self.local_keep = self.keep if self.keep is not None else (1 if self.keep_best is not None else None)

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (for configs and logs); credentials in storage_options are left out."""
        out = asdict(self)
        out["save_interval"] = None if self.save_interval is None else self.save_interval.to_timestring()
        out.pop("storage_options")
        return out


def check_local_dir(path: str) -> str:
    """``path`` as an absolute local path whose directory this process can create or write into; else a
    ValueError naming the problem and the fix."""
    fix = "Fix: pass a node-local directory every worker can write, like local_dir='/local_nvme/checkpoints'."
    if "://" in path and not path.startswith("file://"):
        raise ValueError(
            f"CheckpointConfig(local_dir={path!r}) is not a local path: the local tier is a node-local disk beside "
            f"object storage (save_folder/storage_path stays the source of truth). {fix}"
        )
    path = os.path.abspath(path[len("file://") :] if path.startswith("file://") else path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"CheckpointConfig(local_dir={path!r}): {existing!r} is a file, not a directory. {fix}")
    try:  # a real write (as root, or on a read-only mount, the mode bits do not tell); leaves nothing behind
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(
            f"CheckpointConfig(local_dir={path!r}) is not writable by this process ({existing!r}: {e}). {fix}"
        ) from None
    return path
