"""`MixtureOrderLoader`: a Ray worker's train loader over a `MixtureSource`, with per-source counts.

The batches are the global order's (`GlobalOrderLoader`: the feeder serves the mixed stream like
any seekable train set). What this adds is which source each row came from: the rank's positions
of global batch ``k`` are known (the feeder's cut: ``rank_rows`` of ``[position + k * g, ...)``,
the short tail joined to the batch before it), so the same order the feeder streams (the
`MixturePlan` of the run's `MixtureRun`, carried by the shard, each global batch listed by
source from the loader's start position: `MixturePlan.batch_sources`) names their sources without
reading anything.
The counts of each batch are set as the train thread takes it (not in the prefetch thread; a packed
batch's tokens once the loop finished it on the device, `device_transforms`, so the counter sees its
``document_ids``), and
`MixtureCounts` (brought by `loop_callbacks`, as `MixtureLoader` does locally) sums them on the
loop's per-batch collective: the run's exact per-source samples and, with
``get_num_tokens_in_batch``, tokens (counted on each source's rows of the batch), logged as
``mixture/samples/<source>`` / ``mixture/tokens/<source>`` and so in the driver's history and
report, and saved with each source's cursor in the checkpoint.

Cost per batch on a rank: a plan walk over its own positions (O(batch + log segment), about 0.6 ms
of Python per call whatever its length: `bench/mixture_plan.py`) and, with tokens counted, one
token count per source present in the batch (the batch's rows of that source). While a global batch
is small (`_PLAN_WINDOW` positions cover two or more), one walk covers the positions of the next
several global batches and each batch takes its rows' part of it: one walk per that many batches.

An ``online=`` mixture: the loader brings `OnlineMixture` along (as the local `MixtureLoader` does),
whose decision at an eval end calls `switch` with the mixture plus a switch stage at the next global
batch. The feeder's stream is ahead of that batch, so the loader leaves it (its prefetched batches of
the old order dropped) and enters the epoch again at the switch position under the new mixture
(`EpochFeeder.start_epoch(..., mixture=)`), exactly as a resume at that position would: the order after
a switch is a function of (seed, history, position) on any number of workers (docs/data.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence

from raytrain_events.core.callback import Callback
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.segments import is_segmented
from raytrain_events.data.mixture_counts import MixtureCounts
from raytrain_events.data.online_mixture import OnlineMixture
from raytrain_events.data.ray.feeder import batch_end, rank_rows
from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard, _call_feeder

__all__ = ["MixtureOrderLoader"]

_PLAN_WINDOW = 4096  # positions one plan walk covers when they hold two or more global batches


class MixtureOrderLoader(GlobalOrderLoader):
    """`GlobalOrderLoader` over a `MixtureSource`, counting each batch's rows and tokens per source."""

    def __init__(
        self, shard: GlobalOrderShard, *, tokens_of_batch: Optional[Callable[[Any], int]] = None, **options: Any
    ) -> None:
        super().__init__(shard, **options)
        if shard.mixture is None:
            raise ValueError("MixtureOrderLoader needs a shard of a MixtureSource (RayTrainer(mixture=...)).")
        self.run = shard.mixture
        self.plan = self.run.plan()
        self.mixture = self.plan.mixture
        self._switch_pending = False  # `switch` during an epoch: the stream re-enters at the next batch
        self.tokens_of_row = tokens_of_batch  # MixtureCounts counts tokens when this is set
        names = self.mixture.names
        self.batch_samples: List[int] = [0] * len(names)
        self.batch_tokens: List[int] = [0] * len(names)
        self.batch_sources: List[int] = []  # the source of each row of this rank's latest batch
        self._uncounted: Optional[List[int]] = None  # a packed batch's sources, counted once it is finished
        self._window: tuple[int, int, List[int]] = (-1, 0, [])  # (epoch, first position, their sources)
        self._anchor = 0  # the position the stream entered the epoch at (set per iteration)

    def bind(self, **kwargs: Any) -> None:
        """The plan is the driver's (the shard's `MixtureRun`), the feeder's too: nothing to bind here."""

    @property
    def total_samples(self) -> Optional[int]:
        """The run's samples (for 'dur' stages), the driver's `MixtureRun`'s."""
        return self.run.total_samples

    def switch(self, mixture: Mixture) -> None:
        """Train on ``mixture`` (this one with a switch stage added at the next global batch: `OnlineMixture`)
        from the next batch on. Between epochs (a resume replaying the history) the next ``iter()`` streams it;
        during one, the current stream is left after the batch just trained (its prefetched batches, of the old
        order, dropped) and the feeder's stream of the epoch entered again at the switch position under the new
        mixture, as a resume there enters it (see the module doc)."""
        if mixture == self.mixture:
            return  # a rollback's reload of the history this loader trains already
        if not mixture.continues(self.shard.mixture.mixture):
            raise MixtureError("MixtureOrderLoader.switch takes the run's mixture with switch stages added.")
        self.run = replace(self.run, mixture=mixture)
        self.plan = self.run.plan()
        self.mixture = mixture
        self._window = (-1, 0, [])
        self._switch_pending = True

    def _start(self, epoch: int, position: int, resume_batch: int) -> None:
        """Start (or rebuild) the epoch's stream on the feeder from ``position``, in the loader's current order
        (with its online switches, if any: `EpochFeeder.start_epoch`'s ``mixture``)."""
        shard = self.shard
        mixture = None if self.mixture == shard.mixture.mixture else self.mixture
        _call_feeder(
            lambda: shard.feeder.start_epoch.remote(
                epoch, position, shard.order, shard.rank, resume_batch, source=shard.source, mixture=mixture
            )
        )

    def __iter__(self) -> Iterator[Any]:
        self._switch_pending = False  # a switch before the epoch (a resume's history) is in the plan already
        return self._switching(self.epoch, self.position)

    def _switching(self, epoch: int, position: int) -> Iterator[Any]:
        """The epoch's batches from ``position``; after a `switch`, from the next batch's position under the
        new order (a new stream: the old one's prefetched batches are dropped with it)."""
        size, g = self.plan.epoch_size, self.shard.global_batch
        while True:
            self.position = position  # where the feeder's stream enters the epoch (`GlobalOrderLoader.__iter__`)
            self._anchor = position  # its global batches start there
            self._window = (-1, 0, [])
            inner = super().__iter__()
            end = None
            try:
                for k, batch in enumerate(self._counted(inner, epoch, position)):
                    yield batch
                    if self._switch_pending:
                        end = batch_end(position + k * g, size, g, self.shard.data_world_size)
                        break
            finally:
                inner.close()  # the prefetch thread stops; batches it made past this one are dropped
            if end is None or end >= size:
                return  # the epoch is over (a switch at its end applies from the next epoch's start)
            self._switch_pending = False
            position = end  # the order from any batch boundary on is the plan's, whichever switch came there

    def _counted(self, batches: Iterator[Any], epoch: int, position: int) -> Iterator[Any]:
        for k, batch in enumerate(batches):
            a, b = self._rank_positions(position, k)
            sources = self._sources(epoch, a, b)
            samples = [0] * len(self.batch_samples)
            for s in sources:
                samples[s] += 1
            self.batch_samples, self.batch_sources = samples, sources
            if self.tokens_of_row is not None and is_segmented(batch):
                self._uncounted = sources  # a packed batch: counted as the model sees it (`device_transforms`)
            elif self.tokens_of_row is not None:
                self.batch_tokens = self._tokens(batch, sources)
            yield batch

    def device_transforms(self, batch: Any) -> Any:
        """`GlobalOrderLoader.device_transforms`, then a packed batch's tokens per source counted on what it made
        (``tokens_of_batch`` sees the batch the model sees: ``document_ids`` and all)."""
        batch = super().device_transforms(batch)
        if self._uncounted is not None:
            self.batch_tokens, self._uncounted = self._tokens(batch, self._uncounted), None
        return batch

    def _sources(self, epoch: int, a: int, b: int) -> List[int]:
        """The plan's sources of positions ``[a, b)``: from the current window, or a new walk (see the module doc)."""
        at, first, known = self._window
        if at != epoch or a < first or b > first + len(known):
            g = self.shard.global_batch
            span = _PLAN_WINDOW // g * g
            stop = min(max(b, a + span), self.plan.epoch_size) if span >= 2 * g else b
            first, known = a, self.plan.batch_sources(epoch, a, stop, self._anchor, g)
            self._window = (epoch, first, known)
        return known[a - first : b - first]

    def _rank_positions(self, position: int, k: int) -> tuple[int, int]:
        """This rank's global positions of batch ``k`` from ``position`` (the feeder's cut: `feeder.batch_end`, `rank_rows`)."""
        shard, size = self.shard, self.plan.epoch_size
        world = shard.data_world_size
        start = position + k * shard.global_batch
        end = batch_end(start, size, shard.global_batch, world)
        return rank_rows(start, end, shard.rank // shard.tensor_parallel, world)

    def batch_facts(self) -> List[int]:
        """What `sources_of` needs of this rank's latest batch, kept with a batch: its rows' sources."""
        return self.batch_sources

    @staticmethod
    def sources_of(facts: List[int]) -> List[int]:
        """The source (its index in ``mixture.names``) of each row of the batch ``facts`` describe."""
        return facts

    def tokens_of_rows(self, batch: Any, index: Sequence[int], facts: List[int]) -> int:
        """Tokens of the rows ``index`` of ``batch`` (``tokens_of_batch`` of those rows; 0 without it)."""
        count = self.tokens_of_row
        if count is None or not index:
            return 0
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"Counting the tokens of some rows of a batch needs dict batches (got {type(batch).__name__}): leave "
                "collate_fn unset, or return a dict of tensors from it."
            )
        import torch  # deferred as in `_tokens`: the loader module imports without torch

        rows = len(facts)
        at = torch.tensor(list(index), dtype=torch.long)
        part = {
            key: value[at.to(value.device)] if torch.is_tensor(value) and value.ndim and len(value) == rows else value
            for key, value in batch.items()
        }
        return int(count(part))

    def _tokens(self, batch: Any, sources: List[int]) -> List[int]:
        import torch

        count = self.tokens_of_row
        assert count is not None
        tokens = [0] * len(self.batch_tokens)
        present = sorted(set(sources))
        if len(present) == 1:
            tokens[present[0]] = int(count(batch))
            return tokens
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"Counting tokens per mixture source needs dict batches (got {type(batch).__name__}): leave "
                "collate_fn unset, or return a dict of tensors from it."
            )
        which = torch.tensor(sources)
        for s in present:
            mask = which == s
            part = {
                key: value[mask.to(value.device)] if torch.is_tensor(value) else value for key, value in batch.items()
            }
            tokens[s] = int(count(part))
        return tokens

    def loop_callbacks(self) -> List[Callback]:
        """What the `Trainer` adds for this loader: the per-source counts (`MixtureCounts`) and, for an
        ``online=`` mixture, its policy (`OnlineMixture`, first: a resume's saved switches load before the counts)."""
        if self.mixture.online is not None:
            return [OnlineMixture(self), MixtureCounts(self)]
        return [MixtureCounts(self)]
