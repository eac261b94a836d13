"""What the driver checks of the datasets before Ray starts, from metadata only (Parquet footers).

``columns`` against the train set's columns (a `ParquetRowGroups` source or a mixture's sources; a
bare ``ray.data.read_parquet`` is checked once the driver has its files), and ``steps_per_epoch``
against the batches the train set's known row count makes (a value that disagrees would bend
every 'ep'/'dur' time and the LR schedule). Called by `driver_checks.check_on_driver`, and by the
driver once a Ray Dataset's row count is known. Cost: nothing beyond the footers already read.
"""

from __future__ import annotations

import difflib
from typing import Any, List, Mapping, Optional

from raytrain_events.data.ray.feeder import batches_in_epoch
from raytrain_events.data.ray.parquet_seek import is_seekable
from raytrain_events.ray.plan import global_batch_of

__all__ = ["check_columns", "check_steps_per_epoch", "epoch_batches"]


def check_columns(columns: Optional[List[str]], sources: Mapping[str, Any]) -> None:
    """Refuse ``columns`` naming a column a seekable train source lacks (its schema is in the footers)."""
    if not columns:
        return
    for name, source in sources.items():
        schema = getattr(source, "schema", None)
        names = list(getattr(schema, "names", None) or [])
        if not names:
            continue  # a Ray Dataset: its schema is known only once Ray runs it; the first batch checks it
        missing = [c for c in columns if c not in names]
        if missing:
            hints = [f"{close[0]!r} for {c!r}" for c in missing if (close := difflib.get_close_matches(c, names, 1))]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise ValueError(
                f"columns={columns!r} names {missing}, which datasets[{name!r}] does not have{hint}; its columns are "
                f"{names}. Fix: columns= of those names, or None for every column."
            )


def epoch_batches(spec: Any, rows: int) -> Optional[int]:
    """Global batches in an epoch of ``rows`` rows for this run (None for an elastic group, sized at start)."""

    workers = spec.scaling.workers
    if not isinstance(workers, int):
        return None
    batch = global_batch_of(spec)
    return batches_in_epoch(rows, batch.rows(workers), batch.readers(workers))


def check_steps_per_epoch(spec: Any, train: Any, rows: Optional[int] = None) -> None:
    """Refuse a ``steps_per_epoch`` other than the batches the train set's rows make, where they are known
    (a seekable source counts them from its footers; ``rows`` when the driver counted them)."""
    if spec.data.steps_per_epoch is None or spec.failures.fault_tolerance is not None or spec.data.deterministic_split:
        return  # replica groups and a deterministic split cut epochs their own way (loader.py, replica_groups.py)
    if rows is None:
        if not is_seekable(train):
            return
        rows = train.count()
    batches = epoch_batches(spec, rows)
    if batches is not None and batches != spec.data.steps_per_epoch:
        raise ValueError(
            f"steps_per_epoch={spec.data.steps_per_epoch}, but the train set's {rows} rows make {batches} global batches "
            "per epoch here: epoch ends, 'ep'/'dur' times and the LR schedule would follow the wrong count. Fix: leave "
            "steps_per_epoch unset (it is counted from the rows), or pass max_duration in 'ba' to train a part of "
            "an epoch."
        )
