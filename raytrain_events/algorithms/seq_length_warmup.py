"""`SeqLengthWarmup`: start language-model training on short sequences and grow them.

At ``AFTER_DATALOADER`` (before samples and tokens are counted, so token-based durations count
the tokens actually trained) the sequence length is
``min_seq_length + step_size * floor(progress * (max_seq_length - min_seq_length) / step_size)``,
where ``progress`` is the elapsed fraction of ``duration`` (``"0.3dur"`` = the first 30% of the
run, measured with ``state.get_elapsed_duration()`` so a run in tokens works; or a Time in
ep/ba/sp/tok). ``truncate=True`` cuts each sequence; ``truncate=False`` reshapes the batch
into more, shorter sequences so no token is dropped (except a remainder). Li et al., 2021;
Composer's ``SeqLengthWarmup``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.core.time import Time, TimeUnit, ensure_time

__all__ = ["SeqLengthWarmup", "warmup_seq_length"]

DEFAULT_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids")


def warmup_seq_length(progress: float, min_seq_length: int, max_seq_length: int, step_size: int) -> int:
    """Sequence length after ``progress`` (0..1, clipped) of the warmup."""
    progress = min(max(progress, 0.0), 1.0)
    grown = step_size * int(progress * (max_seq_length - min_seq_length) / step_size)
    return min(max_seq_length, min_seq_length + grown)


@register_algorithm("seq_length_warmup")
class SeqLengthWarmup(Algorithm):
    """Linearly warm up the sequence length of dict batches.

    Example::

        Trainer(..., algorithms=[SeqLengthWarmup(duration="0.3dur", min_seq_length=8, max_seq_length=1024)])

    ``max_seq_length=None`` uses the length of the batches themselves. ``keys`` are the
    ``(N, S, ...)`` tensors to cut; keys the batch does not have are skipped.
    """

    def __init__(
        self,
        duration: Union[str, Time, float] = "0.3dur",
        min_seq_length: int = 8,
        max_seq_length: Optional[int] = None,
        step_size: int = 8,
        truncate: bool = True,
        keys: Sequence[str] = DEFAULT_KEYS,
    ) -> None:
        self.duration = (
            Time(float(duration), TimeUnit.DURATION)
            if isinstance(duration, float)
            else ensure_time(duration, TimeUnit.BATCH)
        )
        if self.duration.value <= 0:
            raise ValueError(f"duration={self.duration.to_timestring()!r} must be positive, like '0.3dur'.")
        if min_seq_length < 1 or step_size < 1:
            raise ValueError(
                f"min_seq_length={min_seq_length!r} and step_size={step_size!r} must be positive integers."
            )
        if max_seq_length is not None and max_seq_length < min_seq_length:
            raise ValueError(f"max_seq_length={max_seq_length!r} must be >= min_seq_length={min_seq_length!r}.")
        self.min_seq_length, self.max_seq_length = int(min_seq_length), max_seq_length
        self.step_size, self.truncate = int(step_size), bool(truncate)
        self.keys = tuple(keys)
        self.seq_length: Optional[int] = None

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_DATALOADER

    def progress(self, state) -> float:
        """Elapsed fraction of the warmup."""
        if self.duration.unit == TimeUnit.DURATION:
            return float(state.get_elapsed_duration().value) / self.duration.value
        return state.timestamp.get_value(self.duration.unit) / self.duration.value

    def apply(self, event: Event, state, logger) -> None:
        batch = state.batch
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"SeqLengthWarmup needs dict batches with keys like {list(self.keys)}, got {type(batch).__name__}."
            )
        present = [k for k in self.keys if k in batch]
        if not present:
            raise KeyError(
                f"SeqLengthWarmup found none of {list(self.keys)} in the batch (keys {sorted(batch)}); pass keys=[...]."
            )
        full = batch[present[0]].shape[1]
        max_len = min(self.max_seq_length or full, full)
        length = warmup_seq_length(self.progress(state), min(self.min_seq_length, max_len), max_len, self.step_size)
        if length != self.seq_length:
            logger.log_metrics({"seq_length_warmup/seq_length": length}, step=state.step)
        self.seq_length = length
        if length >= full:
            return None
        new = dict(batch)
        for key in present:
            tensor = batch[key]
            if self.truncate:
                new[key] = tensor[:, :length]
            else:
                keep = (tensor.shape[0] * tensor.shape[1]) // length * length
                flat = tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])[:keep]
                new[key] = flat.reshape(keep // length, length, *tensor.shape[2:])
        state.batch = new
        return None

    def __repr__(self) -> str:
        return (
            f"SeqLengthWarmup(duration={self.duration.to_timestring()!r}, min_seq_length={self.min_seq_length}, "
            f"max_seq_length={self.max_seq_length}, truncate={self.truncate})"
        )
