"""An `argparse.ArgumentParser` whose "unrecognized arguments" error lists the valid options."""

from __future__ import annotations

import argparse
import sys
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
        words = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(words, namespace)
        if extra:
            hint = _as_override(extra, words)
            getattr(parsed, "_parser", self).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed


def _as_override(extra: list, words: list) -> str:
    """A config key given as a flag (``--run-name x``, ``--epochs=3``): the ``key=value`` override it means
    (``words``: the whole command line, where a flag's value follows it)."""
    fixes = []
    for word in extra:
        if not word.startswith("--") or len(word) < 3:
            continue
        key, _, value = word[2:].partition("=")
        at = words.index(word) if word in words else -1
        if not value and 0 <= at < len(words) - 1 and not words[at + 1].startswith("-") and "=" not in words[at + 1]:
            value = words[at + 1]
        fixes.append(f"{key.replace('-', '_')}={value or '...'}")
    if not fixes:
        return ""
    return f"\nconfig keys are key=value overrides, not flags: did you mean {' '.join(fixes)}?"
