"""``python -m raytrain_events`` and the ``raytrain-events`` console script.

Usage::

    python -m raytrain_events train num_workers=2 max_duration=3ep
    python -m raytrain_events runs ls ./runs
    python -m raytrain_events inspect ./runs/<run_name>
    python -m raytrain_events diff ./runs/<run_a> ./runs/<run_b>
"""

from __future__ import annotations

import sys
from typing import List, Optional

from raytrain_events.cli import main as cli_main

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Console-script entry point (``raytrain_events.__main__:main``); returns the exit code."""
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
