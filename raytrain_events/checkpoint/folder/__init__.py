"""A folder of checkpoints: which are committed, which are kept, and the commit that adds one.

``folder.py`` (`CheckpointFolder`) owns a folder's index (``index.py``) and every deletion of a
checkpoint, under the retention ``retention.py`` decides (local keep-N, or Ray-managed where Ray
Train's snapshot decides); ``local_tier.py`` places the node-local copies of its checkpoints (deleted by ``folder.py`` too);
``committer.py`` turns rank 0's save into a committed, indexed,
retained checkpoint, retrying uploads (``retry.py``); ``store.py`` is the folder seen from a
reader: list, pick the latest, load the newest valid one, save in the background. Built on
``format/`` (one checkpoint's bytes) and ``config.py``.

Files:

* ``committer.py``: `Committer`: what rank 0 does to turn a save into a committed, indexed,
  retained checkpoint.
* ``folder.py``: `CheckpointFolder`: the one owner of a checkpoint folder's index and of every
  checkpoint deletion.
* ``local_tier.py``: `LocalTier`: the node-local copies of a folder's checkpoints
  (``CheckpointConfig(local_dir=...)``): where each goes, read first on a restart, kept to ``local_keep``.
* ``index.py``: `CheckpointIndex`: which checkpoints of a folder are committed, kept so that a
  commit costs O(1).
* ``retention.py``: Checkpoint retention and placement, decided once: what each process deletes and
  where it saves.
* ``retry.py``: Retrying a checkpoint's uploads through an object store's bad minutes: backoff,
  then a deadline.
* ``store.py``: A directory of checkpoints: list, pick the latest, prune, load with fallback, save
  async.
"""
