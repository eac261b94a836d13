"""Ray Train glue: the driver (`RayTrainer`), the worker entry point, reports and aggregation.

Data flows one way: the driver's `RunSpec` goes to every worker, each worker runs the same
`Trainer` over its shard, reports rank-local counts and metrics at intervals, and a controller
callback sums them into the driver's global `Timestamp` and metrics history.

Asynchronous validation (``RayTrainer(validation=AsyncValidation(...))``): `validation.py` holds the
option and the history bookkeeping, `validate_checkpoint.py` the Ray task that loads a checkpoint
and evaluates it while training goes on.

Files:

* ``_compat.py``: Every private Ray name this package uses, in one place.
* ``aggregate.py``: Driver-side aggregation of worker reports into one global `Timestamp` and
  metrics history.
* ``batch_tensors.py``: An Arrow table (a batch of the train order) as a dict of torch tensors,
  without per-row objects.
* ``block_fetch.py``: A rank's rows of a chunk of batches, each block's rows cut on the node that
  holds the block.
* ``checkpointing.py``: Checkpoints on Ray: our checkpoint directories, registered with Ray Train
  as they commit.
* ``cluster.py``: Connect to Ray: the existing cluster when there is one, else an embedded local
  instance.
* ``console.py``: A Ray run's terminal: the driver's progress bar and the job's own lines; Ray's
  internals stay in its log files.
* ``data.py``: Worker-side data: the train set in one global order, eval sets as Ray shards.
* ``driver.py``: `RayTrainer`: run the event-driven `Trainer` on every Ray Train worker, from the
  driver.
* ``driver_checks.py``: What `RayTrainer` checks on the driver before Ray starts, so a bad run fails
  in seconds, not after start-up.
* ``embedded.py``: The environment of an embedded local Ray instance: what is set before
  ``ray.init`` starts it.
* ``feeder.py``: Global data order for training: every rank's batches are a function of one
  position in one order.
* ``follow.py``: `HistoryFollower`: the driver's view of a run while it trains (progress bar,
  loggers).
* ``health.py``: The start-up health check: every rank meets once, within a deadline, before
  training.
* ``history.py``: The driver's record of a run: a small Ray actor the controller pushes history
  entries to.
* ``mixture_loader.py``: `MixtureOrderLoader`: a Ray worker's train loader over a `MixtureSource`,
  with per-source counts.
* ``mixture_source.py``: `MixtureSource`: a `Mixture` of seekable sources as one seekable train set
  for the `EpochFeeder`.
* ``operations.py``: What keeps a long Ray run operating itself, set up on each worker before its
  `Trainer`.
* ``parquet_seek.py``: `ParquetRowGroups`: a Parquet train source that a resumed epoch enters at
  its position, unread before it.
* ``preemption.py``: Preemption on a Ray worker: a SIGTERM or a notice becomes a committed
  checkpoint at the next batch.
* ``prefetch.py``: `prefetched`: run an iterator in a background thread, a few items ahead of the
  thread that uses them.
* ``progress.py``: The driver's one progress bar for a Ray run: the global Timestamp, loss, latest
  eval metric, throughput, ETA.
* ``replica_checks.py``: Which runs ``fault_tolerance="replica_groups"`` supports, checked on the
  driver before Ray starts; Ray's ``TorchftConfig`` for them.
* ``replica_groups.py``: Replica groups on the worker: the loop under torchft, each step committed
  or trained again.
* ``row_index.py``: `BlockIndex`: an epoch's buffered blocks, found by global row in O(log n) and
  trimmed from the front.
* ``run_loggers.py``: Loggers on Ray: the shipped logger destinations fed from the driver's run
  history.
* ``shuffle.py``: Row-level shuffle of the global order: rows permuted within windows of
  consecutive blocks.
* ``slices.py``: A rank's share of a batch, as typed slices of the epoch's blocks: `RowRange` and
  `Take`.
* ``spec.py``: `RunSpec`: the one definition of a `RayTrainer` run's options.
* ``validate_checkpoint.py``: What one asynchronous validation task does: load a checkpoint,
  evaluate it, record the result.
* ``validation.py``: Asynchronous validation on Ray: evaluate checkpoints as Ray tasks while
  training goes on.
* ``watchdog.py``: The progress watchdog: a hung rank is found, its stack saved and named, and the
  group restarted.
* ``worker.py``: The function every Ray Train worker runs: build the `Trainer` from the `RunSpec`
  and fit.
* ``worker_reports.py``: Worker-side reporting: send rank-local counts and metrics to the
  controller at intervals.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:
    from raytrain_events.ray.driver import RayResult, RayTrainer
    from raytrain_events.ray.spec import RunSpec
    from raytrain_events.ray.validation import AsyncValidation

__all__ = ["AsyncValidation", "RayTrainer", "RayResult", "RunSpec"]

# Loaded on first use: Ray actors of ours (the data feeder, the run history) import modules of this
# package and must not pay for the driver's imports (torch among them).
_LAZY = {
    "RayTrainer": "raytrain_events.ray.driver",
    "RayResult": "raytrain_events.ray.driver",
    "RunSpec": "raytrain_events.ray.spec",
    "AsyncValidation": "raytrain_events.ray.validation",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())
