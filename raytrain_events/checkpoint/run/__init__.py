"""A run's checkpoints: saved at the loop's events, restored at start-up (the loop's side).

``checkpointer.py`` (`Checkpointer`) is what a `Trainer` calls: at a checkpoint event it copies the
state off the device (``staging.py``), hands the upload to the background (``save_channel.py``) and
commits through ``folder/``; at start-up ``loading.py`` picks the newest valid checkpoint once and
applies it (RNGs through ``rng.py``). ``inference.py`` loads one for ``eval()``/``predict()``;
``preemption.py`` saves on SIGTERM in a local ``fit()``. Uses every other subpackage.

Files:

* ``checkpointer.py``: `Checkpointer`: saves the run at checkpoint events, and records what its
  `CheckpointLoader` (``loading.py``, built with the folder, index, local tier and sharded reader) restored.
* ``host_snapshot.py``: `HostSnapshots`: the last two good states of a run in host memory, restored
  without a storage read (`SpikeGuard`'s rollback).
* ``inference.py``: Load a checkpoint into a `Trainer` built for ``eval()``/``predict()`` only (no
  train data, no optimizer).
* ``loading.py``: Restoring a checkpoint into a run (`CheckpointLoader`: what to load at start-up):
  the newest one chosen once and shared, then applied to the `State`.
* ``peer_fill.py``: A full checkpoint's ``state.pt`` on every node's local tier, from rank 0 over the process
  group at a restart.
* ``preemption.py``: SIGTERM (spot reclaim) during a local ``fit()``: save a checkpoint, then stop.
* ``rng.py``: Capture and restore every RNG a run uses (torch, CUDA, numpy, Python) as safe-to-load
  data.
* ``save_channel.py``: `SaveChannel`: what the ranks share so that a save costs the training thread
  only its copy.
* ``staging.py``: `HostStager`: the device-to-host copy of an async save, into host buffers reused
  by later saves.
"""
