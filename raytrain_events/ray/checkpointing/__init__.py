"""Checkpoints on Ray: registered with Ray Train as they commit, and validated while training goes on.

``checkpointing.py`` hands each committed checkpoint directory to Ray Train (and, under Ray-managed
retention, lets Ray's snapshot decide what is kept); asynchronous validation
(``RayTrainer(validation=AsyncValidation(...))``): ``validation.py`` holds the option and the
history bookkeeping, ``validate_checkpoint.py`` the Ray task that loads a checkpoint and evaluates
it.

Files:

* ``checkpointing.py``: Checkpoints on Ray: our checkpoint directories, registered with Ray Train
  as they commit.
* ``validate_checkpoint.py``: What one asynchronous validation task does: load a checkpoint,
  evaluate it, record the result.
* ``validation.py``: Asynchronous validation on Ray: evaluate checkpoints as Ray tasks while
  training goes on.
"""
