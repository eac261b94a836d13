"""An `argparse.ArgumentParser` whose "unrecognized arguments" error lists the valid options."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """Like argparse's, but an unknown flag's error names every option this command accepts."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            message += f"\nvalid options for '{self.prog}': {', '.join(self.valid_options())}"
        super().error(message)

    def valid_options(self) -> list:
        flags = [max(a.option_strings, key=len) for a in self._actions if a.option_strings]
        positionals = [
            a.metavar or a.dest
            for a in self._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        ]
        return flags + [str(p) for p in positionals]

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """Unknown arguments are reported by the subcommand that got them, with its own options."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            getattr(parsed, "_parser", self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed
