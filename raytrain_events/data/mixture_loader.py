"""`MixtureLoader`: the local `Trainer`'s train loader over a `Mixture` of map-style datasets.

Each global batch is the next ``batch_size * world_size`` positions of the mixture's plan
(`raytrain_events.core.mixture_plan`); rank ``r`` takes the ``r``-th contiguous part. The order
depends on (mixture, seed, epoch) only, so it is the same on any number of ranks, and a resume
(`set_position`) starts at the epoch's trained samples without reading or enumerating anything
before them. It brings its own callback (`loop_callbacks`, added by the `Trainer`): the
per-source samples and tokens, counted on the loop's per-batch sum, logged and checkpointed.

Example::

    loader = MixtureLoader(mixture, {"web": web_ds, "code": code_ds, "math": math_ds}, batch_size=32,
                           tokens_of_row=lambda row: int(row["attention_mask"].sum()))
    Trainer(model=m, train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch), ...)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from raytrain_events.core.callback import Callback
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_plan import MixturePlan, run_samples
from raytrain_events.core.time import Time
from raytrain_events.data.mixture_counts import MixtureCounts
from raytrain_events.data.online_mixture import OnlineMixture

__all__ = ["MixtureLoader", "row_schema"]


def row_schema(row: Any) -> Tuple[Tuple[str, str], ...]:
    """A row's columns and types, to compare sources: dict keys or tuple positions, tensor dtypes and ranks."""

    def kind(value: Any) -> str:
        dtype = getattr(value, "dtype", None)
        if dtype is not None:
            return f"{dtype}[{getattr(value, 'ndim', 0)}d]"
        return type(value).__name__

    if isinstance(row, Mapping):
        return tuple(sorted((str(k), kind(v)) for k, v in row.items()))
    if isinstance(row, (tuple, list)):
        return tuple((str(i), kind(v)) for i, v in enumerate(row))
    return (("", kind(row)),)


def _check_mixture_datasets(mixture: Mixture, datasets: Mapping[str, Any], batch_size: int) -> None:
    """Refuse, before any batch, a loader the mixture cannot draw from: not a `Mixture`, a batch size that is not a
    positive int, datasets not named by the mixture's sources, a source whose row count is not the mixture's, or
    sources with different row schemas (columns and types: the most sources' schema is the one expected)."""
    if not isinstance(mixture, Mixture):
        raise TypeError(f"MixtureLoader needs a Mixture, got {type(mixture).__name__}: build one with Mixture(...).")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int (rows per rank per batch).")
    names = list(mixture.names)
    odd = [key for key in datasets if not isinstance(key, str)]
    if odd:
        raise MixtureError(
            f"The datasets' names {odd!r} are not strings: name each dataset by its mixture source, e.g. "
            f"{{{', '.join(repr(str(k)) + ': ...' for k in odd)}}}."
        )
    if sorted(datasets) != sorted(names):
        raise MixtureError(
            f"The datasets are named {sorted(datasets)} but the mixture's sources are {sorted(names)}: "
            "pass one dataset per source, under the source's name."
        )
    schemas: Dict[str, Tuple[Tuple[str, str], ...]] = {}
    for name in names:
        dataset = datasets[name]
        if len(dataset) != mixture.rows(name):
            raise MixtureError(
                f"Source {name!r} has {len(dataset)} rows but the mixture says {mixture.rows(name)}: "
                f"give Mixture(sources={{{name!r}: {len(dataset)}, ...}})."
            )
        schemas[name] = row_schema(dataset[0])
    values = list(schemas.values())
    common = max(values, key=values.count)  # the most sources' schema (the first by name on a tie)
    first = next(n for n in names if schemas[n] == common)
    for name in names:
        if schemas[name] != common:
            raise MixtureError(
                f"Source {name!r} has another schema than {first!r} ({dict(schemas[name])} vs "
                f"{dict(common)}): mixed sources must share their columns and types; convert it first."
            )


class MixtureLoader:
    """Batches of a `Mixture` over map-style datasets (``len`` and ``[row]``), one per source name."""

    yields_batches = True  # a loader of batches, passed to Trainer as it is (core/data_spec.check_loader)

    def __init__(  # noqa: PLR0913 (the mixture, its datasets, then keyword-only loader options)
        self,
        mixture: Mixture,
        datasets: Mapping[str, Any],
        *,
        batch_size: int,
        seed: Optional[int] = None,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
        drop_last: bool = False,
        tokens_of_row: Optional[Callable[[Any], int]] = None,
    ) -> None:
        _check_mixture_datasets(mixture, datasets, batch_size)
        names = list(mixture.names)
        self.mixture, self.datasets, self.batch_size, self.seed = mixture, dict(datasets), batch_size, seed
        self.drop_last, self.tokens_of_row = drop_last, tokens_of_row
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.collate_fn = collate_fn
        self.rank, self.world_size = 0, 1
        self._plan: Optional[MixturePlan] = None  # built at fit start (`bind`), or on first use
        self._total: Optional[int] = None  # the run's samples (for 'dur' stages), from `bind`
        self.epoch_size: int = mixture.epoch_size or 0
        self.epoch, self._position = 0, 0
        self._datasets = [self.datasets[n] for n in names]
        # This rank's rows of each source in the latest batch, and their tokens (0 without tokens_of_row).
        self.batch_samples: List[int] = [0] * len(names)
        self.batch_tokens: List[int] = [0] * len(names)
        self.batch_rows: List[Tuple[int, int]] = []  # (source, row) of each row of this rank's latest batch

    def batch_facts(self) -> List[Tuple[int, int]]:
        """What `tokens_of_rows` needs of this rank's latest batch, kept with a batch: its rows' (source, row)."""
        return self.batch_rows

    @staticmethod
    def sources_of(facts: List[Tuple[int, int]]) -> List[int]:
        """The source (its index in ``mixture.names``) of each row of the batch ``facts`` describe."""
        return [source for source, _ in facts]

    def tokens_of_rows(self, batch: Any, index: Sequence[int], facts: List[Tuple[int, int]]) -> int:
        """Tokens of the rows ``index`` of a batch (``tokens_of_row`` of each row as read; 0 without it)."""
        del batch  # counted on the rows as read, like `tokens_in_batch`
        count = self.tokens_of_row
        if count is None:
            return 0
        return sum(int(count(self._datasets[s][r])) for s, r in (facts[i] for i in index))

    # ------------------------------------------------------------- the loop
    def bind(self, *, rank: int, world_size: int, seed: Optional[int], max_duration: Optional[Time[Any]]) -> None:
        """Take the run's rank, world size, seed and length (for 'dur' stages); the loop calls it at fit start."""
        self.rank, self.world_size = rank, world_size
        total = self._total = run_samples(max_duration, self.epoch_size, self.global_batch)
        seed = self.seed if self.seed is not None else (seed or 0)
        self._plan = self.mixture.plan(seed=seed, total_samples=total, global_batch=self.global_batch)

    @property
    def plan(self) -> MixturePlan:
        """The run's order (`MixturePlan`); unbound (outside a `Trainer`) 'dur' stages cannot be resolved."""
        if self._plan is None:
            self._plan = self.mixture.plan(seed=self.seed or 0, global_batch=self.global_batch)
        return self._plan

    @property
    def total_samples(self) -> Optional[int]:
        """The run's length in samples when known (max_duration in 'ep', 'sp' or 'ba'), from `bind`."""
        return self._total

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_position(self, sample_in_epoch: int) -> None:
        """Start the next iteration at this global position of the epoch (a mid-epoch resume)."""
        self._position = sample_in_epoch

    def tokens_in_batch(self, batch: Any) -> int:
        """This rank's tokens in the latest batch (``DataSpec(get_num_tokens_in_batch=loader.tokens_in_batch)``)."""
        del batch
        return sum(self.batch_tokens)

    def _rank_slice(self, position: int) -> Optional[Tuple[int, int]]:
        """This rank's positions of the global batch starting at ``position``; None when the epoch is done."""
        size, width, ranks = self.epoch_size, self.global_batch, self.world_size
        left = size - position
        if left <= 0:
            return None
        if left >= width:
            start = position + self.rank * self.batch_size
            return start, start + self.batch_size
        base, extra = divmod(left, ranks)
        if self.drop_last or base == 0:  # a rank would get nothing: the partial batch is dropped
            return None
        start = position + self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def __len__(self) -> int:
        full, left = divmod(self.epoch_size, self.global_batch)
        return full + (1 if left and not self.drop_last and left >= self.world_size else 0)

    def __iter__(self) -> Iterator[Any]:
        position, self._position = self._position, 0
        epoch = self.epoch
        while True:
            part = self._rank_slice(position)
            if part is None:
                return
            plan = self.plan  # read per batch: an online policy (`OnlineMixture`) may switch it between batches
            rows = plan.rows(epoch, part[0], part[1])
            samples, tokens = [0] * len(self._datasets), [0] * len(self._datasets)
            items = []
            for source, row in rows:
                item = self._datasets[source][row]
                items.append(item)
                samples[source] += 1
                if self.tokens_of_row is not None:
                    tokens[source] += int(self.tokens_of_row(item))
            self.batch_samples, self.batch_tokens, self.batch_rows = samples, tokens, rows
            position = min(position + self.global_batch, plan.epoch_size)
            yield self.collate_fn(items)

    def switch(self, mixture: Mixture) -> None:
        """Train on ``mixture`` (this one with switch stages added: `Mixture.continues`) from the next batch on."""
        if mixture.sources != self.mixture.sources or mixture.epoch_size != self.mixture.epoch_size:
            raise MixtureError("MixtureLoader.switch takes this loader's mixture with switch stages added.")
        self.mixture = mixture
        self._plan = mixture.plan(seed=self.plan.seed, total_samples=self._total, global_batch=self.global_batch)

    def loop_callbacks(self) -> List[Callback]:
        """What the `Trainer` adds for this loader: the per-source counts (`MixtureCounts`) and, for an
        ``online=`` mixture, its policy (`OnlineMixture`, first: a resume's saved switches load before the counts)."""
        if self.mixture.online is not None:
            return [OnlineMixture(self), MixtureCounts(self)]
        return [MixtureCounts(self)]
