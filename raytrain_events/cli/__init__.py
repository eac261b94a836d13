"""The ``raytrain-events`` command line (``python -m raytrain_events``) and the example jobs.

Subcommands: ``train`` (the digits job from a YAML config plus ``key=value`` overrides),
``runs ls`` (runs under a storage root), ``inspect`` (a run's config, summary and
checkpoints) and ``diff`` (the config differences between two runs). ``examples/train.py``
calls the same ``train`` code, so the example and the CLI share one config schema.

Importing this package imports neither Ray nor torch; each subcommand imports what it needs.
"""

from raytrain_events.cli.errors import UsageError

__all__ = ["UsageError", "main"]


def main(argv=None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 run failed, 2 bad input)."""
    from raytrain_events.cli.main import main as _main

    return _main(argv)
