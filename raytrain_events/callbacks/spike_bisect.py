"""The torch side of `SpikeGuard(bisect=True)`: replay a rolled-back window on groups of its rows to find
the rows that spiked it (`search_window`), train the rest of the window (`retrain_window`), and drop
quarantined rows from later batches (`QuarantineFilter`). The decisions are ``core/quarantine.py``'s.

Every rank runs the same steps in the same order: a test forwards this rank's rows of the group (none:
no forward) and one sum across ranks (the loss sum, the row count) gives every rank the same answer, so
the culprits, the quarantine and the retrained window are agreed without a vote. Nothing is committed
during the search: forwards under ``no_grad`` from the restored state; the guard restores the snapshot
again afterwards (train-mode forwards move batch-norm statistics and draw dropout's RNG).

Rows are named by a batch column (``row_key``: an integer id per row, e.g. the dataset's row number),
so the quarantine holds at any world size, across resumes and in the Ray feeder and local loaders alike:
the filter reads the column of whatever batch a rank got. Needs each rank to train its own rows with an
unsharded model (local, DDP): FSDP/TP replays would need matching forwards on every rank, refused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import fsspec
import torch
from torch.distributed.tensor import DTensor

from raytrain_events.core.callback import Callback
from raytrain_events.core.logger import Logger
from raytrain_events.core.precision import autocast_context
from raytrain_events.core.quarantine import Quarantine, excess_test, find_culprits
from raytrain_events.core.state import State
from raytrain_events.trainer._batch import total_loss

#: A count on the loop's per-batch sum: the rows the quarantine dropped, every rank's (cumulative per fit).
QUARANTINED = "spike_quarantined_rows"
#: Counts beside it, registered only where they have a job: the dropped rows' tokens (where the loop counts
#: tokens) and, for a mixture, the dropped rows of each source (the name + the source's name).
QUARANTINED_TOKENS = "spike_quarantined_tokens"
QUARANTINED_SOURCE = "spike_quarantined_rows/"

__all__ = [
    "QUARANTINED",
    "QUARANTINED_SOURCE",
    "QUARANTINED_TOKENS",
    "QuarantineHooks",
    "Found",
    "QuarantineFilter",
    "bisect_window",
    "count_dropped",
    "device_of",
    "read_quarantine",
    "retrain_window",
    "row_ids",
    "search_window",
    "start_quarantine",
    "sum_over_ranks",
    "take_rows",
]


def sum_over_ranks(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> List[float]:
    """``values`` summed over every rank of the default process group (this rank's alone without one).

    Called only where every rank calls it at the same point (the fit's last batch, a bisection's test)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(values)
    tensor = torch.tensor(list(values), dtype=dtype, device=device)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()  # type: ignore[no-any-return]


def device_of(state: State) -> torch.device:
    """Where a collective's tensor lives: the model's device (NCCL sums CUDA tensors only)."""
    param = next(iter(state.model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def row_ids(batch: Any, key: str) -> torch.Tensor:
    """The batch's row ids (column ``key``), a 1-d integer tensor; a clear error when the batch has none."""
    column = batch.get(key) if isinstance(batch, Mapping) else None
    if not torch.is_tensor(column) or column.ndim != 1 or column.is_floating_point():
        raise ValueError(
            f"SpikeGuard(row_key={key!r}) needs each batch to be a dict with an integer column {key!r} (one id per "
            f"row, e.g. the dataset's row number); this batch has {type(batch).__name__}"
            f"{' keys ' + str(sorted(map(str, batch))) if isinstance(batch, Mapping) else ''}. Add the column in the "
            "dataset, or pass the row_key it has."
        )
    return column


def take_rows(batch: Any, index: torch.Tensor, rows: int) -> Any:
    """The rows ``index`` of a batch (every tensor whose first dimension is the batch's ``rows``)."""
    if torch.is_tensor(batch):
        return batch[index.to(batch.device)] if batch.ndim and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return {k: take_rows(v, index, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, index, rows) for v in batch)
    return batch


def read_quarantine(url: str) -> Quarantine:
    """A quarantine file (`Quarantine.dumps`), local or on any fsspec store; a clear error before any work."""
    try:
        with fsspec.open(url, "r") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ValueError(
            f"quarantine_from={url!r}: no such file. Write one with `raytrain-events ledger RUN --export-quarantine FILE`."
        ) from None
    return Quarantine.loads(text, where=f"quarantine_from={url!r}")


def _loss(state: State, batch: Any) -> torch.Tensor:
    with autocast_context(state.precision, device_of(state).type):
        outputs = state.model(batch)
        loss = state.model.loss(outputs, batch)
    return loss if type(loss) is torch.Tensor else total_loss(loss)


def _slice_rows(batch: Any, lo: int, hi: int, rows: int) -> Any:
    """Rows ``[lo, hi)`` of a batch of ``rows`` rows, as views."""
    if torch.is_tensor(batch):
        return batch[lo:hi] if batch.ndim and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return {k: _slice_rows(v, lo, hi, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice_rows(v, lo, hi, rows) for v in batch)
    return batch


def _concat(parts: List[Any]) -> Any:
    """The parts' rows as one batch (tensors stacked along rows), or None where their shapes differ."""
    first = parts[0]
    if torch.is_tensor(first):
        if first.ndim == 0 or any(not torch.is_tensor(p) or p.shape[1:] != first.shape[1:] for p in parts):
            return None
        return torch.cat(parts)
    if isinstance(first, Mapping):
        out = {}
        for key in first:
            joined = _concat([p[key] for p in parts])
            if joined is None:
                return None
            out[key] = joined
        return out
    return None


@dataclass
class Found:
    """A search's outcome: the culprits' ids (every rank has all), this rank's culprit rows per window batch,
    the rows forwarded in all ranks together, the window's rows, and the seconds it took."""

    ids: List[int]
    drops: List[List[int]]
    rows_forwarded: int
    window_rows: int
    seconds: float


def search_window(state: State, batches: Sequence[Any], row_key: str, mean: float, ratio: float) -> Found:
    """Find the rows of the window (``batches``: this rank's, oldest first) that alone would spike a batch.

    The window's rows in one global order (batch by batch, rank by rank); `find_culprits` bisects it; each
    test forwards this rank's rows of the group and sums (loss x rows, rows) over the ranks."""
    start = time.perf_counter()
    device, world, rank = device_of(state), max(1, state.world_size), state.rank
    counts = [len(row_ids(b, row_key)) for b in batches]
    layout = [0.0] * (len(batches) * world) + [mean, 1.0]
    for w, count in enumerate(counts):
        layout[w * world + rank] = float(count)
    summed = sum_over_ranks(layout, device)
    everyone = [int(v) for v in summed[:-2]]
    mean_all = summed[-2] / summed[-1]  # every rank's trailing mean, averaged: one threshold everywhere
    total = sum(everyone)
    batch_rows = total / max(1, len(batches) * world)  # a rank's batch, on average
    mine: List[Tuple[int, int]] = []  # this rank's [first, last) global index per window batch
    offset = 0
    for w in range(len(batches)):
        first = offset + sum(everyone[w * world : w * world + rank])
        mine.append((first, first + counts[w]))
        offset += sum(everyone[w * world : (w + 1) * world])

    # This rank's rows of any group [a, b) of the global order are one run of its own rows in window order:
    # with the window's batches stacked once, a test is a slice (a view) and one forward.
    stacked = _concat(list(batches)) if len(batches) > 1 else None
    starts = [sum(counts[:w]) for w in range(len(batches))]  # each batch's first row in the stack

    def guilty(a: int, b: int) -> bool:
        parts, sizes = [], []
        spans = [(w, max(a, f) - f, min(b, t) - f) for w, (f, t) in enumerate(mine) if max(a, f) < min(b, t)]
        if stacked is not None and spans:
            lo, hi = starts[spans[0][0]] + spans[0][1], starts[spans[-1][0]] + spans[-1][2]
            parts, sizes = [_slice_rows(stacked, lo, hi, sum(counts))], [hi - lo]
        else:
            for w, lo, hi in spans:
                parts.append(_slice_rows(batches[w], lo, hi, counts[w]))
                sizes.append(hi - lo)
        loss_sum = 0.0
        with torch.no_grad():
            for part, size in zip(parts, sizes):
                loss_sum += float(_loss(state, part)) * size
        rows = sum(sizes)
        loss_all, rows_all = sum_over_ranks([loss_sum, float(rows)], device)
        return excess_test(loss_all, int(rows_all), mean_all, ratio, batch_rows)

    culprits, tested = find_culprits(total, guilty) if total > 1 else ([], 0)
    drops: List[List[int]] = [[] for _ in batches]
    ids = [0] * len(culprits)
    for n, index in enumerate(culprits):
        for w, (first, last) in enumerate(mine):
            if first <= index < last:
                drops[w].append(index - first)
                ids[n] = int(row_ids(batches[w], row_key)[index - first])
    if culprits:  # each culprit's id is known on its rank only: one sum gives every rank all of them
        ids = [int(v) for v in sum_over_ranks(ids, device, torch.int64)]
    return Found(ids, drops, tested, total, time.perf_counter() - start)


def retrain_window(state: State, batches: Sequence[Any], drops: Sequence[Sequence[int]], row_key: str) -> List[float]:
    """Train the window's batches again without the dropped rows: per batch a plain step (forward, loss,
    backward, gradients averaged over the ranks in one sum, every optimizer's step, every scheduler's step;
    no algorithms, no microbatches, no closures). This rank's losses, in order (NaN for an empty part)."""
    params = [p for opt in state.optimizers for group in opt.param_groups for p in group["params"]]
    world = max(1, state.world_size)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and world > 1
    losses: List[float] = []
    for batch, drop in zip(batches, drops):
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        n, dropped = len(row_ids(batch, row_key)), set(drop)
        keep = torch.tensor([i for i in range(n) if i not in dropped], dtype=torch.long)
        if len(keep):
            part = take_rows(batch, keep, n) if drop else batch
            loss = _loss(state, part)
            (loss if state.scaler is None else state.scaler.scale(loss)).backward()
            losses.append(float(loss.detach()))
        else:
            losses.append(float("nan"))
        if distributed:  # DDP's average, as one flat sum (a rank with no rows adds zeros)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat)
            flat /= world
            at = 0
            for p, g in zip(params, grads):
                p.grad = flat[at : at + g.numel()].view_as(g).clone()
                at += g.numel()
        for optimizer in state.optimizers:
            if state.scaler is None:
                optimizer.step()
            else:
                state.scaler.step(optimizer)
        if state.scaler is not None:
            state.scaler.update()
        for scheduler in state.schedulers:
            scheduler.step()
    return losses


class QuarantineHooks(Callback):
    """The `SpikeGuard`'s quarantine hooks (added at INIT only with a ``row_key``): `QuarantineFilter` marks each
    batch at ``AFTER_DATALOADER`` (its dropped rows ride on the loop's per-batch sum), drops the rows at
    ``BATCH_START``, and zeroes the loss of a rank whose every row is quarantined at ``AFTER_LOSS``."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def after_dataloader(self, state: State, logger: Logger) -> None:
        guard = self.guard  # before the loop counts the batch: its rows still count as positions
        row_filter = guard._filter
        row_filter.mark(state.batch, guard._qids)
        for name, value in zip(row_filter.count_names, row_filter.local_counts()):
            state.agreement.set_count(name, value)

    def batch_start(self, state: State, logger: Logger) -> None:
        self.guard._filter.apply(state)

    def after_loss(self, state: State, logger: Logger) -> None:
        if self.guard._filter.zero_loss:
            state.loss = total_loss(state.loss) * 0.0


class QuarantineFilter:
    """Drops quarantined rows from each batch: `mark` at ``AFTER_DATALOADER`` (before the loop counts the batch,
    so the Timestamp keeps counting positions, and this rank's dropped rows ride on the loop's per-batch sum),
    `apply` at ``BATCH_START``. A rank whose every row is quarantined keeps its batch and trains it with its
    loss times 0 (`zero_loss`): every rank still runs its forward and backward."""

    def __init__(self, row_key: str) -> None:
        self.row_key = row_key
        self.dropped = 0  # this rank's rows dropped in this fit (the per-batch sum adds every rank's)
        self.tokens = 0  # ... and their tokens (where the loop counts tokens)
        self.by_source: List[int] = []  # ... and their rows per mixture source (`names` order)
        self.names: List[str] = []  # the mixture's sources (none: not a mixture)
        self.count_names: List[str] = [QUARANTINED]  # the counts on the loop's per-batch sum (`local_counts`)
        self.zero_loss = False
        self._keep: Optional[torch.Tensor] = None
        self._rows = 0
        self._ids: Optional[torch.Tensor] = None  # the quarantine's ids, sorted, on the batch's device
        self._size = -1
        self._count: Optional[Callable[[Any], int]] = None
        self._loader: Any = None

    def bind(self, count_tokens: Optional[Callable[[Any], int]], loader: Any) -> List[str]:
        """At INIT: the loop's token counter (``state.count_tokens``; None: no tokens counted) and a mixture's
        loader (`MixtureLoader`/`MixtureOrderLoader`: each row's source, tokens per row; None: no mixture).
        Returns the counts to register on the per-batch sum."""
        self._count = count_tokens
        self._loader = loader if hasattr(loader, "batch_facts") else None
        self.names = list(loader.mixture.names) if self._loader is not None else []
        self.by_source = [0] * len(self.names)
        tokens = [QUARANTINED_TOKENS] if count_tokens is not None else []
        self.count_names = [QUARANTINED, *tokens, *(QUARANTINED_SOURCE + n for n in self.names)]
        return self.count_names

    @property
    def counts_tokens(self) -> bool:
        return self._count is not None

    def reset(self) -> None:
        """A fit's start: the cumulative counts start again (the guard reads them as per-batch differences)."""
        self.dropped, self.tokens, self.by_source = 0, 0, [0] * len(self.names)

    def local_counts(self) -> List[int]:
        """This rank's cumulative counts, in `count_names` order."""
        return [self.dropped, *([self.tokens] if self._count is not None else []), *self.by_source]

    def facts(self) -> Any:
        """What `count` needs of the latest batch besides its tensors (a mixture's rows' sources), or None."""
        return self._loader.batch_facts() if self._loader is not None else None

    def count(self, batch: Any, index: torch.Tensor, rows: int, facts: Any) -> Tuple[int, List[int]]:
        """Tokens and rows per source (`names` order) of the rows ``index`` of ``batch`` (of ``rows`` rows;
        ``facts``: `facts` as it was at that batch): the loop's token counter on those rows, or a mixture's
        ``tokens_of_row``/``tokens_of_batch``."""
        tokens, per = 0, [0] * len(self.names)
        loader, at = self._loader, index.tolist()
        if self._count is not None:
            if loader is not None and loader.tokens_of_row is not None:  # its tokens_in_batch ignores its batch
                tokens = int(loader.tokens_of_rows(batch, at, facts))
            else:
                tokens = int(self._count(take_rows(batch, index, rows)))
        if loader is not None:
            sources = loader.sources_of(facts)
            for i in at:
                per[sources[i]] += 1
        return tokens, per

    def mark(self, batch: Any, quarantined: List[int]) -> None:
        self._keep, self.zero_loss = None, False
        if not quarantined:
            return
        ids = row_ids(batch, self.row_key)
        if self._ids is None or self._size != len(quarantined) or self._ids.device != ids.device:
            self._ids = torch.tensor(quarantined, dtype=ids.dtype, device=ids.device)
            self._size = len(quarantined)
        hit = torch.isin(ids, self._ids)
        dropped = int(hit.sum())  # one host read per batch, only while the quarantine holds rows
        if dropped:
            self.dropped += dropped
            self._rows = len(ids)
            self._keep = (~hit).nonzero().flatten()
            if self._count is not None or self._loader is not None:  # only on a batch that drops rows
                tokens, per = self.count(batch, hit.nonzero().flatten(), len(ids), self.facts())
                self.tokens += tokens
                self.by_source = [a + b for a, b in zip(self.by_source, per)]

    def apply(self, state: State) -> None:
        keep, self._keep = self._keep, None
        if keep is None:
            return
        if len(keep) == 0:
            self.zero_loss = True
            return
        state.batch = take_rows(state.batch, keep, self._rows)


def count_dropped(guard: Any, state: State, logger: Logger) -> Optional[Tuple[int, int, Dict[str, int]]]:
    """At ``BATCH_END``: this batch's quarantined rows, every rank's (the per-batch sums are cumulative: the
    difference to the guard's last read), as (rows, tokens, rows per mixture source), counted in
    ``state.skipped``; None when the batch dropped none. ``guard``: the `SpikeGuard`."""
    row_filter = guard._filter
    totals = [state.agreement.total(name) for name in row_filter.count_names]
    deltas, guard._dropped_totals = [t - last for t, last in zip(totals, guard._dropped_totals)], totals
    if not deltas[0]:
        return None
    tokens = deltas[1] if row_filter.counts_tokens else 0
    names = row_filter.names
    by_source = {n: d for n, d in zip(names, deltas[len(deltas) - len(names) :]) if d} if names else {}
    state.skipped.add_quarantined(deltas[0], tokens, by_source)
    logger.log_metrics({"spikes/quarantined_rows": state.skipped.quarantined})
    return deltas[0], tokens, by_source


def start_quarantine(guard: Any, state: State, data: Dict[str, Any]) -> None:
    """``guard``: the `SpikeGuard` (typed Any: it imports this module). The quarantine's data checked (and the user's file merged in) at each fit's start."""
    assert guard._filter is not None
    if guard.bisect and any(isinstance(p, DTensor) for p in state.model.parameters()):
        raise ValueError(
            "SpikeGuard(bisect=True) replays a window on each rank's own rows with an unsharded model (local, "
            "DDP); this model is sharded (FSDP/TP). Use bisect=False (the window is skipped)."
        )
    if "sources" not in data:  # a plain dataset: its length, when the loader knows it
        try:
            data["dataset_len"] = len(state.train_dataloader.dataset)
        except (AttributeError, TypeError):
            pass
    data["row_key"] = guard.row_key
    if guard.row_ids is not None:
        if "sources" not in data:
            raise ValueError(
                "SpikeGuard(row_ids='mixture') numbers a Mixture's rows, but this run trains no Mixture: drop row_ids."
            )
        data["row_ids"] = guard.row_ids
    guard.quarantine.check_fingerprint(data)
    guard.quarantine.fingerprint.update(data)
    if guard._from_file is not None:
        guard.quarantine.merge(guard._from_file)  # refused when recorded on other data
    guard._qids = guard.quarantine.ids()
    guard._filter.reset()


def bisect_window(
    guard: Any, state: State, restored: int, now: int, window: List[Tuple[int, int, int, int, int]]
) -> Dict[str, Any]:
    """Replay the window from the restored state to find its culprit rows (`search_window`), quarantine them
    and train the rest of the window (`retrain_window`); ``retrained`` False: skip the window after all."""
    assert guard._snapshots is not None and guard.row_key is not None and guard.detector.loss_ratio is not None
    batches = list(guard._batches)[len(guard._batches) - (now - restored) :]
    found = search_window(state, batches, guard.row_key, guard.detector.loss_mean, guard.detector.loss_ratio)
    guard._snapshots.restore(lambda meta: meta["batch"] == restored)  # the search's forwards undone (BN, RNG)
    out: Dict[str, Any] = {
        "quarantined": found.ids,
        "search_rows": found.rows_forwarded,
        "window_rows": found.window_rows,
        "search_s": round(found.seconds, 4),
        "retrained": False,
    }
    if not found.ids:  # no row explains the spike alone
        return out
    for row in found.ids:
        guard.quarantine.add(row, window[0][1], window[0][2])
    guard._qids = guard.quarantine.ids()
    losses = retrain_window(state, batches, found.drops, guard.row_key)
    bad = any(guard.detector.judge(v) is not None for v in losses if not math.isnan(v))
    if sum_over_ranks([1.0 if bad else 0.0], device_of(state))[0] > 0:
        guard._snapshots.restore(lambda meta: meta["batch"] == restored)  # more than the culprits: skip it all
        return out
    for value in losses:
        if not math.isnan(value):
            guard.detector.observe(value)
    # Not trained (the rows dropped from the window stay counted): the culprits, their tokens and sources.
    row_filter, facts = guard._filter, list(guard._facts)[len(guard._facts) - len(batches) :]
    tokens, per = 0, [0] * len(row_filter.names)
    for batch, drop, fact in zip(batches, found.drops, facts):
        if drop:
            t, p = row_filter.count(
                batch, torch.tensor(drop, dtype=torch.long), len(row_ids(batch, guard.row_key)), fact
            )
            tokens, per = tokens + t, [a + b for a, b in zip(per, p)]
    if row_filter.counts_tokens or per:  # every rank has its own culprits' rows: one sum gives all of them
        summed = [int(v) for v in sum_over_ranks([tokens, *per], device_of(state), torch.int64)]
        tokens, per = summed[0], summed[1:]
    by_source = {n: k for n, k in zip(row_filter.names, per) if k}
    state.skipped.add_quarantined(len(found.ids), tokens, by_source)
    out["retrained"] = True
    return out
