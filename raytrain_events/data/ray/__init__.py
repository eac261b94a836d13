"""The train data path on Ray: one global order of rows, cut into every rank's batches.

Runs in three processes. On the driver, `TrainDataConfig` (``data_config.py``) hands Ray Train the
datasets; in Train's controller, Ray Data's dataset manager starts one `EpochFeeder` actor
(``feeder.py``) per train set, which orders the epoch's blocks (``row_index.py``; shuffled in
windows, ``shuffle.py``) and answers each rank's "which rows make my next batches?" with typed
slices (``slices.py``); on each worker, `GlobalOrderLoader` (``loader.py``) fetches those rows
(``block_fetch.py``: cut on the node that holds a block), turns them into tensors
(``batch_tensors.py``) a few batches ahead (``prefetch.py``). Sources a resumed epoch enters at its
position: `ParquetRowGroups` (``parquet_seek.py``) and mixtures of sources (``mixture_source.py``,
read by ``mixture_loader.py``). The global batch and the order they follow are the driver's
(``ray/plan.py``), as typed values (``../order.py``). This ``__init__`` imports nothing: the feeder actor
imports only what it runs.

Files:

* ``batch_tensors.py``: An Arrow table (a batch of the train order) as a dict of torch tensors,
  without per-row objects.
* ``block_fetch.py``: A rank's rows of a chunk of batches, each block's rows cut on the node that
  holds the block.
* ``data_config.py``: `TrainDataConfig`: how Ray Train hands the run's datasets to a worker group (the
  train set's feeder and shards, eval sets split by Ray), and `cheap_row_count`.
* ``feeder.py``: Global data order for training: every rank's batches are a function of one
  position in one order.
* ``loader.py``: Worker-side data: the train set in one global order (`GlobalOrderLoader` over a
  `GlobalOrderShard`), eval sets as Ray shards (`ShardLoader`).
* ``mixture_loader.py``: `MixtureOrderLoader`: a Ray worker's train loader over a `MixtureSource`,
  with per-source counts.
* ``mixture_source.py``: `MixtureSource`: a `Mixture` of seekable sources as one seekable train set
  for the `EpochFeeder`.
* ``pack_tokens.py``: Pack token documents offline, once (`pack_tokens`, ``raytrain-events pack``):
  the ``packed`` layout, read by `PackedTokens` with no packing work.
* ``packed_batch.py``: A rank's part of a batch of packed sequences expanded to the public columns
  (straight to tensors, or as an Arrow table).
* ``packed_files.py``: The ``packed`` token layout: pack windows' sequences written once
  (`pack_tokens`), read with no packing work.
* ``packed_reads.py``: The read-task side of `PackedTokens`: what one Ray read task runs (read
  windows of token row groups, pack them into one compact block: `pack_reads`).
* ``packed_source.py``: `PackedTokens`: token documents in Parquet packed into ``seq_len``
  sequences, as a seekable train source.
* ``parquet_seek.py``: `ParquetRowGroups`: a Parquet train source that a resumed epoch enters at
  its position, unread before it.
* ``prefetch.py``: `prefetched`: run an iterator in a background thread, a few items ahead of the
  thread that uses them.
* ``row_index.py``: `BlockIndex`: an epoch's buffered blocks, found by global row in O(log n) and
  trimmed from the front.
* ``text_tokenizer.py``: `TextTokenizer`: the tokenizer `tokenize` encodes with, from a file, a
  folder or a name, never the network.
* ``token_files.py``: Token files' two layouts: ``flat`` (the tokens of many documents end to end,
  plus their lengths) and ``documents``.
* ``tokenize.py``: Tokenize text once on the cluster: text Parquet/JSONL into seekable token Parquet
  (`tokenize`).
* ``shuffle.py``: Row-level shuffle of the global order: rows permuted within windows of
  consecutive blocks.
* ``slices.py``: A rank's share of a batch, as typed slices of the epoch's blocks: `RowRange` and
  `Take`.
"""
