"""The data path: the train order, mixtures, the local mixture loader and, on Ray, the feeder and loaders.

Who owns what, from the run's options to a rank's batch:

* the run's global batch and train order are decided once (`RunPlan`, ``ray/plan.py``, on the driver)
  as the typed values of ``order.py``; a mixture's order is its `MixtureRun` and `MixturePlan` (pure
  logic: ``core/mixture.py``, ``core/mixture_plan.py``);
* locally, `MixtureLoader` (``mixture_loader.py``) serves a `Trainer` the mixture's batches and brings
  `MixtureCounts` (``mixture_counts.py``), the per-source samples and tokens, and for an ``online=``
  mixture `OnlineMixture` (``online_mixture.py``);
* on Ray, ``ray/`` holds the feeder actor, the workers' loaders and the seekable sources (Parquet,
  packed tokens, mixtures), reading the same values.

Imports run one way: ``order.py`` and ``mixture_counts.py`` import only ``core/``; ``mixture_loader.py``
imports them; ``ray/`` imports ``core/``, these and Ray's private names through ``ray/_compat.py``
(``tests/test_ownership.py`` checks the graph). This ``__init__`` imports nothing.

Files:

* ``mixture_counts.py``: `MixtureCounts`: samples and tokens seen per source of a `Mixture`, counted
  like the global Timestamp.
* ``mixture_loader.py``: `MixtureLoader`: the local `Trainer`'s train loader over a `Mixture` of
  map-style datasets.
* ``online_mixture.py``: `OnlineMixture`: a `Mixture`'s weights changed during the run by its
  ``online=`` policy (pure rule: ``core/mixture_online.py``), every change recorded and exact.
* ``order.py``: The train order's small typed values: `GlobalBatch` (rows per optimizer step),
  `TrainOrder` (seed, row shuffle) and the feeder's `EpochOrder`, `StreamStart` and `BatchCut`.

Subpackages:

* ``ray/``: the train data path on Ray: one global order of rows (the feeder actor), cut into every
  rank's batches; seekable Parquet, packed-token and mixture sources.
"""
