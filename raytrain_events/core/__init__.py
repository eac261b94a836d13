"""The loop's vocabulary as pure logic (no Ray, no fsspec, no I/O; ``tests/core/test_imports.py``
guards it): `State`, `Event`, `Engine`, `Algorithm`, `Callback`, `Logger`, `Time`/`Timestamp`.

Names are imported from their modules (``from raytrain_events.core.state import State``); the
public ones are re-exported by ``raytrain_events`` itself.

Files:

* ``agreement.py``: `Agreement`: flags one rank asks for and all ranks agree on at the same batch.
* ``algorithm.py``: The `Algorithm` interface: code that changes the training `State` at chosen
  events.
* ``callback.py``: The `Callback` interface: code that observes the loop (logging, monitoring,
  saving).
* ``data_spec.py``: `DataSpec`: how the loop counts samples and tokens in a batch and splits it
  into microbatches.
* ``engine.py``: The `Engine`: runs algorithms, then callbacks, at each event, and records
  `Trace`s.
* ``event.py``: Training loop events: the fixed points where algorithms and callbacks run.
* ``heartbeat.py``: `Heartbeat`: this process's last sign of progress, and the collective it is
  waiting in.
* ``interval.py``: When to evaluate (or do anything periodic): small pure functions of the
  `Timestamp`.
* ``ledger.py``: `Ledger`: whether a row was trained before a checkpoint and how many times, from the
  mixture's order, the Timestamp and the skip list (no per-row log).
* ``logger.py``: A minimal metrics logger shared by algorithms and callbacks.
* ``mixture.py``: `Mixture`: named sources with weights that change in stages, as plain data.
* ``mixture_online.py``: Online mixture weights: a policy that changes a `Mixture`'s weights during
  one run, as pure functions.
* ``mixture_plan.py``: `MixturePlan`: which source and row each global sample position of an epoch
  reads.
* ``packing.py``: Packing token documents into fixed-length training sequences: pure functions of
  document lengths.
* ``plain.py``: The one converter to plain Python data (for JSON, YAML, Ray reports, logs and
  config diffs).
* ``precision.py``: Numerical precision: resolve "fp32" / "amp_bf16" / "amp_fp16" into an autocast
  context.
* ``quarantine.py``: Culprit rows of a loss spike: `find_culprits` (group testing by halves) and
  `Quarantine` (rows not trained any more, with the data they belong to).
* ``replica_layout.py``: `ReplicaLayout`: which worker is in which replica group, and which rows of a global
  batch each one trains.
* ``save_points.py``: `SavePoints` and `LateSave`: which replica group saves a save point whose saving lead died
  before committing it (a late save by the next lead).
* ``segments.py``: A packed batch's sequences as *segments*: O(runs + sequences) numbers, expanded to
  per-token columns.
* ``spikes.py``: Loss spikes as pure decisions: `SpikeDetector`, `SkipList` (skipped ranges of the
  global order), `Skipped` (positions not trained, beside the Timestamp), `RollbackPolicy`.
* ``state.py``: `State`: everything the loop tracks, what algorithms change, and what checkpoints
  save.
* ``time.py``: Training time: units (epochs, batches, samples, tokens, fraction of the run) and the
  progress counter.
* ``time_value.py``: A quantity of training time: `TimeUnit` (epochs, batches, samples, tokens,
  fraction of the run) and `Time`.
* ``timestamp.py``: The run's progress counter: `Timestamp` (epochs, batches, samples, tokens,
  wall-clock times), and the one map between counter names and units (`COUNTER_UNITS`,
  `report_key`, `counters_of`).
"""
