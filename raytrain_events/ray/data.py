"""Worker-side data: iterate this worker's Ray Dataset shard once per epoch as torch batches.

`ShardLoader` calls ``iter_torch_batches`` afresh each epoch (one pass over the shard), with a
per-epoch seeded local shuffle when asked. `DeterministicSplitDataConfig` gives rank ``r`` the
same contiguous rows every run (``Dataset.split``), which makes runs reproducible and
mid-epoch resume exact; Ray's default streaming split assigns blocks dynamically instead.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ray.train import DataConfig

__all__ = ["ShardLoader", "DeterministicSplitDataConfig"]


class ShardLoader:
    """An iterable over a Ray ``DataIterator`` shard: one full pass per ``iter()``."""

    def __init__(
        self,
        shard: Any,
        *,
        batch_size: int,
        device: Any = "auto",
        collate_fn: Optional[Callable] = None,
        prefetch_batches: int = 1,
        drop_last: bool = False,
        shuffle_buffer_size: Optional[int] = None,
        seed: Optional[int] = None,
        columns: Optional[List[str]] = None,
        length: Optional[int] = None,
    ) -> None:
        self.shard = shard
        self.length = length
        self.batch_size = batch_size
        self.device = device
        self.collate_fn = collate_fn
        self.prefetch_batches = prefetch_batches
        self.drop_last = drop_last
        self.shuffle_buffer_size = shuffle_buffer_size
        self.seed = seed
        self.columns = columns
        self.epoch = 0

    def __len__(self) -> int:
        """Batches per epoch, when the driver could tell (the loop uses it for epoch-based time)."""
        if self.length is None:
            raise TypeError("This shard's length is unknown; pass steps_per_epoch to RayTrainer.")
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """Called by the loop at each epoch start: reseeds the local shuffle."""
        self.epoch = epoch

    def __iter__(self):
        kwargs: Dict[str, Any] = dict(
            batch_size=self.batch_size,
            prefetch_batches=self.prefetch_batches,
            drop_last=self.drop_last,
            device=self.device,
        )
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        if self.shuffle_buffer_size:
            kwargs["local_shuffle_buffer_size"] = self.shuffle_buffer_size
            kwargs["local_shuffle_seed"] = None if self.seed is None else self.seed + self.epoch
        batches = self.shard.iter_torch_batches(**kwargs)
        if self.columns is None:
            return iter(batches)
        return _check_columns(batches, self.columns)


def _check_columns(batches, columns: List[str]):
    first = True
    for batch in batches:
        if first and isinstance(batch, dict):
            missing = [c for c in columns if c not in batch]
            if missing:
                raise KeyError(
                    f"The dataset has no column(s) {missing}; its batches have columns {sorted(batch)}. "
                    "Rename the columns (Dataset.rename_columns) or change the model's input/target keys."
                )
        first = False
        yield batch


class DeterministicSplitDataConfig(DataConfig):
    """Split each dataset into equal contiguous parts by rank, the same on every run."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output: List[Dict[str, Any]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            parts = dataset.split(world_size, equal=True)
            for rank, part in enumerate(parts):
                output[rank][name] = part.iterator()
        return output
