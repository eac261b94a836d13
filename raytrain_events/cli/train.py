"""``train``: the digits job from a YAML config plus ``key=value`` overrides.

Shared by ``raytrain-events train`` and ``examples/train.py`` (which passes its bundled
``configs/digits.yaml`` as the default ``--config``).
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from raytrain_events.cli.config import keys_help, load_config
from raytrain_events.cli.errors import run_guarded
from raytrain_events.cli.parser import ArgumentParser

__all__ = ["add_train_arguments", "make_train_parser", "run_train", "example_main"]

DESCRIPTION = """\
Train a classifier on scikit-learn's bundled 8x8 digits (no download) with RayTrainer:
the data is written as Parquet into the run directory and read back with Ray Data,
training runs on Ray Train workers (an embedded local Ray, or the cluster this runs in),
checkpoints go to <storage>/<run_name>/checkpoints, and a summary is printed and saved
as <storage>/<run_name>/summary.json."""

EPILOG_HEAD = """\
overrides are OmegaConf dot-list items: key=value, nested.key=value, lists and dicts in
YAML flow style (quote them for the shell):
  num_workers=4 max_duration=3ep storage=s3://my-bucket/runs checkpoint.keep=3
  'algorithms=[label_smoothing, {name: mixup, alpha: 0.2}]'
Durations are Time strings: a number then ep, ba, sp or tok (and dur for warmup),
like 3ep, 200ba, 1e4sp, 0.1dur.

config keys (the schema; YAML files and overrides may set only these):
"""

EXIT_CODES = """
exit codes: 0 trained, 1 training failed, 2 bad input (unknown key or flag, bad value or
duration, unreachable storage or Ray address)."""


def add_train_arguments(parser: argparse.ArgumentParser, *, default_config: Optional[str] = None) -> None:
    """The options of ``train`` (shared by the CLI subcommand and examples/train.py)."""
    from raytrain_events.cli.digits import DigitsConfig

    parser.description = DESCRIPTION
    parser.epilog = EPILOG_HEAD + keys_help(DigitsConfig) + "\n" + EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    default_text = f" (default: {default_config})" if default_config else " (default: none; the schema defaults below)"
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=default_config,
        help="YAML config file with any of the config keys listed below; overrides win over it" + default_text + ".",
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


def make_train_parser(prog: str, *, default_config: Optional[str] = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog)
    add_train_arguments(parser, default_config=default_config)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """Load and check the config, then train (or print the config with --print-config)."""
    from omegaconf import OmegaConf

    from raytrain_events.cli.digits import DigitsConfig, train_digits

    cfg = load_config(DigitsConfig, config_path=args.config, overrides=args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    train_digits(cfg)
    return 0


def example_main(argv: Optional[List[str]] = None, *, prog: str, default_config: Optional[str] = None) -> int:
    """Entry point of ``examples/train.py``: parse, run, exit code (2 on bad input, never a traceback)."""
    parser = make_train_parser(prog, default_config=default_config)
    args = parser.parse_args(argv)
    return run_guarded(lambda: run_train(args), prog=prog)
