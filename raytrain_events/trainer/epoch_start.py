"""`epoch_iterator`: where an epoch's train data starts, including mid-epoch after a resume.

A loader with ``set_position`` (the Ray global-order loader) starts after the epoch's trained
samples itself. Any other loader is iterated from the epoch's start and the trained batches are
skipped; with the checkpoint's RNG states the epoch start is replayed exactly (a shuffling
sampler draws from the global RNG in ``iter()``), then training continues from the saved state.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

from raytrain_events.checkpoint.run.rng import restore_rng_state
from raytrain_events.core.state import State
from raytrain_events.trainer._setup import set_epoch

__all__ = ["epoch_iterator"]


def epoch_iterator(loader: Any, state: State, resume_rng: Optional[Tuple[Any, Any]]) -> Tuple[Iterator[Any], int]:
    """``loader``'s iterator for ``state.epoch``, past the batches already trained; and how many those are."""
    set_epoch(loader, state.epoch)
    skip = state.timestamp.batch_in_epoch.value  # mid-epoch resume: batches already trained
    set_position = getattr(loader, "set_position", None)
    if skip and callable(set_position):
        set_position(state.timestamp.sample_in_epoch.value)
        resume_rng = None
    if skip and resume_rng is not None:
        restore_rng_state(resume_rng[0])
    iterator = iter(loader)
    for _ in range(0 if callable(set_position) else skip):
        next(iterator, None)
    if skip and resume_rng is not None:
        restore_rng_state(resume_rng[1])
    return iterator, skip
