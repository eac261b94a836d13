"""``train``: run an entry point with its config from the schema defaults, a YAML file and ``key=value`` overrides.

``raytrain-events train [ENTRY] [--config PATH] [key=value ...]`` runs any ``module:function`` or
``path/to/file.py:function`` (see `raytrain_events.cli.entry`; default: the digits job,
``examples/train.py:train_digits``). A script makes itself a command line the same way with
`config_main` (``sys.exit(config_main(train, sys.argv[1:], prog="train.py"))``): ``--help`` lists
the config keys, ``--print-config`` shows the merged config, and bad input exits 2 with a message.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any, Callable, List, Optional, Tuple

from raytrain_events.cli.config import keys_help, load_config
from raytrain_events.cli.entry import DEFAULT_ENTRY, config_schema, is_entry_spec, load_entry, send_by_value
from raytrain_events.cli.errors import UsageError, run_guarded
from raytrain_events.cli.parser import ArgumentParser

__all__ = ["add_train_arguments", "run_train", "run_entry", "config_main", "split_entry"]

OVERRIDES_HELP = """\
overrides are OmegaConf dot-list items: key=value, nested.key=value, lists and dicts in
YAML flow style (quote them for the shell):
  num_workers=4 max_duration=3ep storage=s3://my-bucket/runs checkpoint.keep=3
  'algorithms=[label_smoothing, {name: mixup, alpha: 0.2}]'
Durations are Time strings: a number then ep, ba, sp or tok (and dur for warmup),
like 3ep, 200ba, 1e4sp, 0.1dur.
"""

EXIT_CODES = """
exit codes: 0 trained, 1 training failed, 2 bad input (unknown key or flag, bad value or
duration, unreachable storage or Ray address, an entry point that cannot be loaded)."""

ENTRY_HELP = f"""\
ENTRY is the function to run: module:function (importable on every node) or
path/to/file.py:function; default {DEFAULT_ENTRY} (the digits job), found in the current
directory or the source checkout. It takes its config as its first parameter, annotated with
a dataclass: the config keys below are that schema's.
"""


def split_entry(words: List[str]) -> Tuple[Optional[str], List[str]]:
    """``(entry, the other words)`` of ``train``'s arguments: the first word like ``x:y`` (no ``=``) names the entry.

    It is taken out before argparse sees the words (an optional positional before ``key=value``
    items would swallow the first override, and options between them would split the two).
    """
    after_config = False
    for i, word in enumerate(words):
        if not after_config and is_entry_spec(word):
            return word, words[:i] + words[i + 1 :]
        after_config = word == "--config"
    return None, list(words)


def add_train_arguments(
    parser: argparse.ArgumentParser, fn: Optional[Callable[..., Any]], *, entry_arg: bool, load_error: str = ""
) -> None:
    """The options of a ``train`` command for entry point ``fn`` (its docstring and config keys in --help)."""
    schema = config_schema(fn) if fn is not None else None
    doc = inspect.getdoc(fn) if fn is not None else None
    parser.description = doc or "Run a training entry point with its config."
    keys = keys_help(schema) if schema is not None else "  (none: the entry point takes no config)"
    if load_error:
        keys = f"  (the entry point could not be loaded: {load_error})"
    parser.epilog = (
        (ENTRY_HELP + "\n" if entry_arg else "")
        + OVERRIDES_HELP
        + "\nconfig keys (the schema; YAML files and overrides may set only these):\n"
        + keys
        + "\n"
        + EXIT_CODES
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if entry_arg:  # ENTRY is taken out of the words before parsing (see split_entry)
        parser.usage = f"{parser.prog} [-h] [--config PATH] [--print-config] [ENTRY] [key=value ...]"
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="YAML config file with any of the config keys listed below; overrides win over it "
        "(default: none; the schema defaults below).",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="Print the merged config (defaults <- --config <- overrides) as YAML and exit without training.",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="Config overrides, applied after --config (see 'overrides' and 'config keys' below).",
    )


def run_entry(
    fn: Callable[..., Any], *, config_path: Optional[str] = None, overrides: List[str] = (), print_config: bool = False
) -> int:
    """Build ``fn``'s config (defaults <- ``config_path`` <- ``overrides``) and call ``fn`` with it."""
    from omegaconf import OmegaConf

    schema = config_schema(fn)
    if schema is None:
        if config_path or overrides:
            raise UsageError("This entry point takes no config: drop --config and the key=value overrides.")
        if print_config:
            return 0
        send_by_value(fn)
        result = fn()
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    cfg = load_config(schema, config_path=config_path, overrides=overrides)
    if print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    send_by_value(fn)
    result = fn(cfg)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_train(args: argparse.Namespace) -> int:
    """``raytrain-events train``: the parsed arguments' entry point, config and overrides."""
    entry, overrides = args.entry, list(args.overrides)
    if entry is not None and not is_entry_spec(entry):  # argparse gave the first override to ENTRY
        entry, overrides = None, [entry] + overrides
    return run_entry(load_entry(entry), config_path=args.config, overrides=overrides, print_config=args.print_config)


def config_main(fn: Callable[..., Any], argv: Optional[List[str]] = None, *, prog: str) -> int:
    """A script's command line for entry point ``fn``: parse ``argv``, run, exit code (2 on bad input)."""
    parser = ArgumentParser(prog=prog)
    add_train_arguments(parser, fn, entry_arg=False)
    args = parser.parse_args(argv)
    return run_guarded(
        lambda: run_entry(fn, config_path=args.config, overrides=args.overrides, print_config=args.print_config),
        prog=prog,
    )
