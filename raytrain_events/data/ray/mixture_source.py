"""`MixtureSource`: a `Mixture` of seekable sources as one seekable train set for the `EpochFeeder`.

``RayTrainer(mixture=Mixture(...), datasets={"web": ParquetRowGroups(...), "code": ..., ...})``:
the driver checks the sources (`check_mixture`, before Ray starts) and builds one
`MixtureSource`, which the run then treats as its ``"train"`` set: the feeder streams it, cuts it
into global batches and hands each rank its contiguous part, exactly as a single seekable source,
so resumes, resizes, feeder restarts and the bounded buffer need nothing new.

The order: the plan's positions of each global batch (the feeder's ``global_batch`` positions,
counted from where its stream entered the epoch) listed source by source
(`MixturePlan.batch_sources`): each global batch holds the rows the plan puts at its positions (a
batch's gradient does not depend on the order of its rows), in one run per source, so a rank's part
of a batch is one or two slices of its sources' blocks. (In the plan's own interleaved order, runs
of 1-3 positions, a rank's 32-row part was about 20 slices, and a 3-source mixture ran at half a
single source's rate in ``bench/data_scale.py``.) The ``t``-th row a source gives in an epoch is row
``t`` of that source's own seekable order (``source.stream(seed, epoch, row)``: its row groups in
file order, or permuted by the run's seed), going round again (another permutation per pass) once
``t`` reaches its rows. So every row a stage chooses is trained once per epoch, and a source asked
for more than it holds repeats only after all of them. A stream entered again after a feeder
restart enters at a global batch's start, so its batches are the same.

A stream entered at position ``p`` (a resume) computes each source's cursor
(``plan.cursors(e, p)``: O(sources * log(segment)), nothing enumerated) and opens each source at
its cursor's row group: nothing before any source's position is read. Stream cost: one plan walk
per about 4,096 positions (whole global batches) and one slice per source per global batch (and one
more where a source's run crosses a block), so the feeder's index holds about as many entries per
global batch as there are sources; a rank's batch is one or two slices of the sources' blocks, cut
where the blocks are (`block_fetch`: one call per node for all of a chunk's blocks there).

The per-source counts are not read from rows: each rank knows its positions of each global batch,
so its loader (`mixture_loader.MixtureOrderLoader`) asks the same plan which source each row came
from (the run's `MixtureRun`, made once on the driver: ``ray/plan.py``, travels with the shard).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_plan import MixturePlan, MixtureRun
from raytrain_events.data.ray.feeder import bundle_blocks
from raytrain_events.data.ray.parquet_seek import as_seekable, is_seekable
from raytrain_events.data.ray.token_files import refuse_token_rows

__all__ = ["MixtureSource", "check_mixture", "mixture_train_set"]

_PLAN_STEP = 4096  # positions whose sources are computed at once
_PASS_SEED = 1_000_003  # a source's pass p > 0 is permuted with seed + p * this


class _Cursor:
    """One source's rows from its ``taken``-th row of the epoch on, as block pieces ``(ref, offset, rows)``."""

    def __init__(self, source: Any, seed: Optional[int], epoch: int, taken: int) -> None:
        self.source, self.seed, self.epoch = source, seed, epoch
        self.rows = int(source.count())
        self.pass_, within = divmod(taken, self.rows)
        self._open(within)

    def _open(self, row: int) -> None:
        seed = self.seed if self.seed is None or self.pass_ == 0 else self.seed + self.pass_ * _PASS_SEED
        bundles, first, _ = self.source.stream(seed, self.epoch, row, 0)
        self.bundles: Iterator[Any] = iter(bundles)
        self.skip = row - first  # rows of the first row group before the cursor: not trained
        self.pieces: List[Tuple[Any, int, int]] = []

    def take(self, n: int) -> List[Tuple[Any, int, int]]:
        out: List[Tuple[Any, int, int]] = []
        while n > 0:
            if not self.pieces:
                bundle = next(self.bundles, None)
                if bundle is None:  # the pass is over: the next one, in another order
                    self.pass_ += 1
                    self._open(0)
                    continue
                for ref, offset, count in bundle_blocks(bundle):
                    cut = min(self.skip, count)
                    self.skip -= cut
                    if count > cut:
                        self.pieces.append((ref, offset + cut, count - cut))
                continue
            ref, offset, count = self.pieces[0]
            used = min(n, count)
            out.append((ref, offset, used))
            n -= used
            if used == count:
                self.pieces.pop(0)
            else:
                self.pieces[0] = (ref, offset + used, count - used)
        return out


class MixtureSource:
    """A `Mixture`'s sources as one seekable train set (``count`` and ``stream``: see the module doc).

    ``run``: what fixes the order besides the sources (`MixtureRun`: the mixture, the plan's seed, the
    run's samples for 'dur' stages, the global batch for 'ba' ones); ``order_seed``: the seed each
    source's row groups are permuted with (None: file order).
    """

    def __init__(self, sources: Mapping[str, Any], run: MixtureRun, order_seed: Optional[int]) -> None:
        self.mixture: Mixture = run.mixture
        self.sources = [sources[name] for name in self.mixture.names]
        self.run = run
        self.order_seed = order_seed
        self._plan: Optional[MixturePlan] = None
        self._switched: Tuple[Optional[Mixture], Optional[MixturePlan]] = (None, None)  # the latest switched plan

    @property
    def plan(self) -> MixturePlan:
        if self._plan is None:
            self._plan = self.run.plan()
        return self._plan

    def plan_of(self, mixture: Optional[Mixture]) -> MixturePlan:
        """The order under ``mixture`` (this run's mixture with the switch stages an online policy added), or
        the run's own (None)."""
        if mixture is None or mixture == self.mixture:
            return self.plan
        known, plan = self._switched
        if known != mixture or plan is None:
            if not mixture.continues(self.mixture):
                raise MixtureError(
                    "A switched mixture must be this train set's mixture with switch stages added "
                    f"(Mixture.switched); got {mixture.to_dict()} for {self.mixture.to_dict()}."
                )
            plan = replace(self.run, mixture=mixture).plan()
            self._switched = (mixture, plan)
        return plan

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_plan": None, "_switched": (None, None)}  # rebuilt where used (caches stay local)

    def count(self) -> int:
        """Positions in an epoch (the mixture's epoch size)."""
        return self.plan.epoch_size

    def stream(  # noqa: PLR0913 (the seekable stream protocol, and an online mixture's switched order)
        self,
        seed: Any,
        epoch: int,
        row: int,
        window_rows: int = 0,
        *,
        global_batch: Optional[int] = None,
        mixture: Optional[Mixture] = None,
    ) -> Tuple[Iterator[Any], int, int]:
        """``(bundles from position ``row`` on, row, 0)``: entered exactly at ``row``, each global batch
        of ``global_batch`` positions from there listed by source (`MixturePlan.batch_sources`), in the order
        of ``mixture`` when given (an online policy's switches, `plan_of`)."""
        del seed  # the order's seeds are the run's (its `MixtureRun`, order_seed), fixed on the driver
        if window_rows:
            raise ValueError("A mixture orders its rows itself: shuffle_buffer_size is not supported with mixture=.")
        return self._bundles(self.plan_of(mixture), epoch, row, global_batch), row, 0

    def _bundles(self, plan: MixturePlan, epoch: int, row: int, global_batch: Optional[int]) -> Iterator[Any]:
        cursors = [
            _Cursor(source, self.order_seed, epoch, taken)
            for source, taken in zip(self.sources, plan.cursors(epoch, row))
        ]
        step = max(1, _PLAN_STEP // global_batch) * global_batch if global_batch else _PLAN_STEP
        position = row
        while position < plan.epoch_size:
            stop = min(position + step, plan.epoch_size)
            sources = plan.batch_sources(epoch, position, stop, row, global_batch)
            i = 0
            while i < len(sources):
                j, s = i, sources[i]
                while j < len(sources) and sources[j] == s:
                    j += 1
                for ref, offset, count in cursors[s].take(j - i):
                    yield SimpleNamespace(
                        blocks=[(ref, SimpleNamespace(num_rows=count))],
                        slices=[SimpleNamespace(start_offset=offset, num_rows=count)],
                    )
                i = j
            position = stop


def check_mixture(mixture: Mapping[str, Any], datasets: Mapping[str, Any], shuffle_buffer_size: Any) -> Dict[str, Any]:
    """The mixture's sources, each as a seekable source; refuses (naming the fix) what cannot be mixed.

    A source missing from ``datasets``, a ``"train"`` entry beside the mixture, a source that cannot
    seek (a Ray Dataset with transforms), a row count other than the mixture's, another schema than
    the other sources' (from the Parquet footers), or a row shuffle (the mixture orders rows itself).
    """

    checked = Mixture.from_dict(mixture)
    names = list(checked.names)
    missing = [n for n in names if n not in datasets]
    if missing:
        raise MixtureError(
            f"The mixture's sources {missing} are not in datasets (its entries: {sorted(datasets)}): pass each "
            "source as datasets={name: ParquetRowGroups(paths) or ray.data.read_parquet(paths), ...}."
        )
    if "train" in datasets and "train" not in names:
        raise ValueError(
            "datasets has a 'train' entry and mixture= is given: with a mixture the train set is the mixture of its "
            "sources. Name the sources' datasets (datasets={'web': ..., 'code': ...}) and leave 'train' out."
        )
    if shuffle_buffer_size:
        raise ValueError(
            f"shuffle_buffer_size={shuffle_buffer_size!r} with mixture=: a mixture orders its rows itself (sources "
            "interleaved by the plan, each source's row groups permuted by seed). Leave shuffle_buffer_size unset."
        )
    sources: Dict[str, Any] = {}
    for name in names:
        source = as_seekable(datasets[name])
        refuse_token_rows(source, name)  # flat token files as plain rows (the footers just read)
        if not is_seekable(source):
            raise TypeError(
                f"Mixture source {name!r} is a {type(datasets[name]).__name__} that cannot seek (a Ray Dataset with "
                "transforms after its read, or another kind of source): a mixture enters every source at its cursor. "
                f"Pass datasets[{name!r}] = ParquetRowGroups(paths) or a bare ray.data.read_parquet(paths) "
                "(write the transformed rows to Parquet first)."
            )
        if source.count() != checked.rows(name):
            rows = {n: (source.count() if n == name else checked.rows(n)) for n in names}
            raise MixtureError(
                f"Source {name!r} has {source.count()} rows but the mixture says {checked.rows(name)}: "
                f"give Mixture(sources={rows}, ...)."
            )
        sources[name] = source
    schemas = {n: getattr(s, "schema", None) for n, s in sources.items()}
    known = {n: s for n, s in schemas.items() if s is not None}
    if known:
        first = next(iter(known))
        for name, schema in known.items():
            if not schema.equals(known[first], check_metadata=False):
                raise MixtureError(
                    f"Source {name!r} has another schema than {first!r} ({_fields(schema)} vs "
                    f"{_fields(known[first])}): mixed sources must share their columns and types; "
                    "convert it first (or select common columns: ParquetRowGroups(paths, columns=[...]))."
                )
    return sources


def _fields(schema: Any) -> Dict[str, str]:
    return {field.name: str(field.type) for field in schema}


def mixture_train_set(spec: Any, datasets: Mapping[str, Any], run: MixtureRun) -> Dict[str, Any]:
    """``datasets`` with the mixture's sources replaced by one ``"train"`` `MixtureSource` of ``run`` (the run
    plan's `MixtureRun`): the driver's step."""
    sources = check_mixture(spec.data.mixture, datasets, spec.data.shuffle_buffer_size)
    out = {name: ds for name, ds in datasets.items() if name not in sources}
    out["train"] = MixtureSource(sources, run, spec.seed)
    return out
