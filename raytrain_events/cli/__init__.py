"""The ``raytrain-events`` command line (``python -m raytrain_events``) and the config tools scripts use.

Subcommands: ``train`` (any ``module:function`` or ``path/to/file.py:function`` entry point, by
default the digits job in ``examples/train.py``, with its config from a YAML file plus
``key=value`` overrides), ``runs ls`` (runs under a storage root), ``inspect`` (a run's config,
summary and checkpoints) and ``diff`` (the config differences between two runs).

What a training script uses (the examples do): `config_main` (the script's command line for
its entry function), `load_config`/`keys_help`/`to_plain` (a dataclass schema <- YAML <-
overrides), `UsageError`/`TrainingFailed`/`run_guarded` (exit 2 / 1 with a message, never a
traceback) and `storage_step` (a storage failure as a `UsageError` naming the URL).

Importing this package imports neither Ray nor torch; each subcommand imports what it needs.

Files:

* ``config.py``: Config loading for the CLI and the examples: a dataclass schema, a YAML file,
  ``key=value`` overrides.
* ``entry.py``: Entry points for ``raytrain-events train``: ``module:function`` or
  ``path/to/file.py:function``.
* ``errors.py``: `UsageError`: bad input from the user (config, flags, storage URL); the CLI exits
  with code 2.
* ``export.py``: ``raytrain-events export``: one consolidated ``state.pt`` from a (sharded or full)
  checkpoint.
* ``ledger.py``: ``raytrain-events ledger RUN --checkpoint C --row SOURCE:N``: was that row trained
  before the checkpoint, and how many times.
* ``main.py``: The ``raytrain-events`` argument parser and dispatch (``python -m
  raytrain_events``).
* ``parser.py``: An `argparse.ArgumentParser` whose "unrecognized arguments" error lists the valid
  options.
* ``runs.py``: ``runs ls``, ``inspect`` and ``diff``: look at run directories on any storage.
* ``summary.py``: A finished run's ``summary.json``: built from the `RayTrainer` result, written,
  printed.
* ``train.py``: ``train``: run an entry point with its config from the schema defaults, a YAML file
  and ``key=value`` overrides.
"""

from raytrain_events.cli.config import keys_help, load_config, to_plain
from raytrain_events.cli.errors import TrainingFailed, UsageError, run_guarded, storage_step

# The function, imported after its submodule loaded: ``import raytrain_events.cli.main`` (which binds the
# submodule as this package's ``main`` on its first import) can no longer replace the function.
from raytrain_events.cli.main import main
from raytrain_events.cli.parser import ArgumentParser
from raytrain_events.cli.train import config_main

__all__ = [
    "ArgumentParser",
    "TrainingFailed",
    "UsageError",
    "config_main",
    "keys_help",
    "load_config",
    "main",
    "run_guarded",
    "storage_step",
    "to_plain",
]
