"""Load a checkpoint into a `Trainer` built for ``eval()``/``predict()`` only (no train data, no optimizer).

`load_for_inference` restores the model (and the algorithm, callback and Timestamp state a full
checkpoint holds; only the weights from a sharded one) and skips what only training uses: optimizer,
scheduler and grad-scaler state, and the RNG state. Such a Trainer never saves, so no run
directory is locked and nothing stays open after the load.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.format.manifest import CheckpointInfo
from raytrain_events.checkpoint.run.checkpointer import Checkpointer, CheckpointHost

__all__ = ["load_for_inference"]


def load_for_inference(host: CheckpointHost, config: CheckpointConfig) -> Optional[CheckpointInfo]:
    """Load per ``config`` (``load_from``, or the newest checkpoint of ``save_folder`` with ``autoresume``)."""
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"checkpoint must be a CheckpointConfig, got {type(config).__name__}.")
    if not config.load_from and not (config.autoresume and config.save_folder):
        raise ValueError(
            "A Trainer without train data only loads checkpoints: pass CheckpointConfig(load_from=<checkpoint URL>) "
            "(or give the Trainer train_dataloader, max_duration and optimizers to train and save)."
        )
    options = dict(lock_run_dir=False, save_interval=None, async_save=False)  # it never saves
    checkpointer = Checkpointer(host, dataclasses.replace(config, **options))
    checkpointer.inference = True
    try:
        info = checkpointer.load()
    finally:
        checkpointer.close()
    if (
        info is None and checkpointer.loaded_safetensors is None
    ):  # autoresume found nothing: evaluating the untrained model would mislead
        raise FileNotFoundError(
            f"No committed checkpoint in save_folder={config.save_folder!r} to evaluate: point load_from at one."
        )
    return info
