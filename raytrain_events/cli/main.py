"""The ``raytrain-events`` argument parser and dispatch (``python -m raytrain_events``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional

from raytrain_events import __version__
from raytrain_events.cli.entry import config_schema, load_entry
from raytrain_events.cli.errors import UsageError, run_guarded
from raytrain_events.cli.export import export_checkpoint
from raytrain_events.cli.ledger import run_ledger
from raytrain_events.cli.parser import ArgumentParser
from raytrain_events.cli.train import add_train_arguments, run_train, split_entry

__all__ = ["build_parser", "main"]

PROG = "raytrain-events"

STORAGE_OPTION_HELP = (
    "fsspec storage option as KEY=VALUE, repeatable; dotted keys nest, e.g. "
    "-o client_kwargs.endpoint_url=http://127.0.0.1:9000 -o key=ACCESS -o secret=SECRET "
    "(default: none; credentials come from the environment as usual)."
)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def build_parser(entry: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line; ``train --help`` describes entry point ``entry`` (default: the digits job)."""
    parser = ArgumentParser(
        prog=PROG,
        formatter_class=_formatter,
        description="raytrain_events: train with the event-driven loop on Ray, and look at runs on any storage.",
        epilog=(
            "examples:\n"
            f"  {PROG} train num_workers=2 max_duration=3ep\n"
            f"  {PROG} train --config examples/configs/digits.yaml storage=s3://my-bucket/runs\n"
            f"  {PROG} train my_package.jobs:train lr=0.1\n"
            f"  {PROG} train path/to/job.py:train --print-config\n"
            f"  {PROG} runs ls ./runs\n"
            f"  {PROG} inspect ./runs/digits-20250101-120000\n"
            f"  {PROG} diff ./runs/run-a ./runs/run-b\n"
            f"  {PROG} report ./runs/digits-20250101-120000\n"
            f"'{PROG} COMMAND --help' explains each command's options."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=ArgumentParser)

    _add_train(commands, entry)
    _add_runs(commands)
    _add_inspect(commands)
    _add_diff(commands)
    _add_export(commands)
    _add_ledger(commands)
    _add_report(commands)
    _add_tokenize(commands)
    _add_pack(commands)
    return parser


def _add_train(commands: Any, entry: Optional[str]) -> None:
    """The ``train`` command: the entry point ``entry``'s config options (loaded here to describe them)."""

    train = commands.add_parser(
        "train",
        help="Run a training entry point (module:function; default the digits job) with a YAML config and key=value overrides.",
        formatter_class=_formatter,
    )
    try:
        fn, load_error = load_entry(entry), ""
        config_schema(fn)
    except UsageError as exc:
        fn, load_error = None, str(exc)
    add_train_arguments(train, fn, entry_arg=True, load_error=load_error)
    train.set_defaults(_parser=train)


def _add_runs(commands: Any) -> None:
    """The ``runs`` commands (``runs ls``)."""
    runs = commands.add_parser(
        "runs",
        help="Commands on the runs under a storage root (runs ls).",
        formatter_class=_formatter,
        description="Commands on the runs under a storage root.",
    )
    runs_commands = runs.add_subparsers(
        dest="runs_command", metavar="RUNS_COMMAND", required=True, parser_class=ArgumentParser
    )
    ls = runs_commands.add_parser(
        "ls",
        help="List the runs under a storage root with their checkpoints and final Timestamp.",
        formatter_class=_formatter,
        description=(
            "List the run directories directly under STORAGE: for each, its status, how many checkpoints it has,\n"
            "the global Timestamp of the newest one, and the final Timestamp and eval accuracy from summary.json.\n"
            "status: running (a live 'running' lock), finished (summary.json written), ended (neither: the run\n"
            "failed or was interrupted, or was not started by the digits job, which is what writes summary.json)."
        ),
    )
    ls.add_argument(
        "storage",
        metavar="STORAGE",
        help="Storage root holding run directories: a local path, file://, s3://bucket/prefix, gs://, az://.",
    )
    _add_common(ls)
    ls.set_defaults(_parser=ls)


def _add_inspect(commands: Any) -> None:
    """The ``inspect`` command: one run's checkpoints, metrics and config."""
    inspect = commands.add_parser(
        "inspect",
        help="Show one run: its checkpoints with their Timestamps, final metrics and saved config.",
        formatter_class=_formatter,
        description=(
            "Show one run directory: the committed checkpoints (oldest first) with the global Timestamp each was\n"
            "saved at (epoch, batch, sample, token), the final Timestamp and metrics from summary.json, and the\n"
            "config the run was started with (config.yaml)."
        ),
    )
    inspect.add_argument(
        "run_url",
        metavar="RUN_URL",
        help="The run directory, <storage>/<run_name>, e.g. ./runs/digits-20250101-120000 or s3://bucket/runs/name.",
    )
    _add_common(inspect)
    inspect.set_defaults(_parser=inspect)


def _add_diff(commands: Any) -> None:
    """The ``diff`` command: two runs' configs compared."""
    diff = commands.add_parser(
        "diff",
        help="Config differences between two runs, line by line.",
        formatter_class=_formatter,
        description=(
            "Compare the saved configs (config.yaml) of two runs key by key. Each difference prints as\n"
            "'- key: value in RUN_A' and '+ key: value in RUN_B'; keys only one run has print on one side only."
        ),
    )
    diff.add_argument("run_a", metavar="RUN_A", help="First run directory (the '-' side).")
    diff.add_argument("run_b", metavar="RUN_B", help="Second run directory (the '+' side).")
    diff.add_argument(
        "-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[], help=STORAGE_OPTION_HELP
    )
    diff.set_defaults(_parser=diff)
    diff.add_argument(
        "--exit-code",
        action="store_true",
        help="Exit with 1 when the configs differ (like git diff --exit-code); default: exit 0 either way.",
    )


def _add_export(commands: Any) -> None:
    """The ``export`` command: a checkpoint consolidated into one file."""
    export = commands.add_parser(
        "export",
        help="Consolidate a (sharded) checkpoint into one state.pt with full tensors, e.g. for inference.",
        formatter_class=_formatter,
        description=(
            "Read a checkpoint (an FSDP-sharded one through the safe DCP reader, in this one process) and write\n"
            "one torch.save file: 'model' (a plain state_dict), 'optim' (by parameter name) and the training state."
        ),
    )
    export.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="A checkpoint directory, or a folder of them (the newest)."
    )
    export.add_argument("output", metavar="OUTPUT", help="The file to write, e.g. ./model.pt or s3://bucket/model.pt.")
    export.add_argument("--model-only", action="store_true", help="Keep only the model weights.")
    export.add_argument(
        "--format",
        choices=["pt", "safetensors"],
        default="pt",
        help="pt: one torch.save file; safetensors: a directory of .safetensors files (model weights only, "
        "written one tensor at a time), as Hugging Face and vLLM load them.",
    )
    export.add_argument(
        "--hf-config", metavar="CONFIG_JSON", help="With --format safetensors: copy this config.json in (HF directory)."
    )
    _add_common(export)
    export.set_defaults(_parser=export)


def _add_ledger(commands: Any) -> None:
    """The ``ledger`` command: whether a row was trained before a checkpoint."""
    ledger = commands.add_parser(
        "ledger",
        help="Was a row trained before a checkpoint, and how many times (no per-row log is kept or read).",
        formatter_class=_formatter,
        description=(
            "Answer from the checkpoint's Timestamp, the run's mixture order (seed, stages) and the SpikeGuard's\n"
            "skip list whether row N of SOURCE was trained before the checkpoint, and in which epochs. A plain\n"
            "(non-mixture) run's one source is 'train', its rows in the dataset's own order; its SpikeGuard\n"
            "quarantine is answered too. --export-quarantine FILE writes the quarantine for a later run's\n"
            "SpikeGuard(quarantine_from=FILE)."
        ),
    )
    ledger.add_argument("run_url", metavar="RUN_URL", help="The run directory, <storage>/<run_name>.")
    ledger.add_argument("--row", default=None, metavar="SOURCE:N", help="The source and row number, e.g. web:1234.")
    ledger.add_argument(
        "--export-quarantine",
        default=None,
        metavar="FILE",
        help="Write the checkpoint's quarantined rows to FILE, for SpikeGuard(quarantine_from=FILE) in a later run.",
    )
    ledger.add_argument(
        "--checkpoint",
        default=None,
        metavar="C",
        help="A checkpoint name under RUN_URL/checkpoints or a URL (default: the newest).",
    )
    _add_common(ledger)
    ledger.set_defaults(_parser=ledger)


def _add_report(commands: Any) -> None:
    """The ``report`` command: report.html and plots of a run or sweep."""
    report = commands.add_parser(
        "report",
        help="Write report.html and PNG plots into a run (or sweep) directory.",
        formatter_class=_formatter,
        description=(
            "Write a static report.html plus PNGs into RUN_DIR. A run directory: train loss and every eval metric\n"
            "against global samples (and tokens when counted), learning rate, throughput with checkpoints and\n"
            "restarts marked, the run config. A sweep directory: the algorithm sets compared (the metric against\n"
            "global samples, a line per trial, the best highlighted) and the results table."
        ),
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="A run directory (<storage>/<run_name>) or a sweep's.")
    report.add_argument("--metric", help="Sweeps: the metric to compare (default: the sweep's, else an accuracy).")
    report.add_argument("--mode", choices=["min", "max"], help="Sweeps: whether the metric is better low or high.")
    report.add_argument(
        "-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[], help=STORAGE_OPTION_HELP
    )
    report.set_defaults(_parser=report)


def _add_tokenize(commands: Any) -> None:
    tokenize = commands.add_parser(
        "tokenize",
        help="Tokenize text (Parquet/JSONL) once on Ray Data into seekable token Parquet for PackedTokens.",
        formatter_class=_formatter,
        description=(
            "Turn text files into token Parquet (input_ids, num_tokens, document_id, source) with a Hugging Face\n"
            "tokenizer (a tokenizer.json, a saved transformers tokenizer folder, or a name in the local cache; nothing\n"
            "is downloaded), one shard per input file under OUTPUT/<source>/. Inputs and OUTPUT may be URLs\n"
            "(s3://bucket/text/, with -o storage options). Resumable (finished shards are kept) and idempotent (a\n"
            "rerun over the same inputs writes nothing). See data/ray/tokenize.py."
        ),
    )
    tokenize.add_argument(
        "inputs", metavar="[SOURCE=]PATH", nargs="+", help="Input files, folders or globs; SOURCE= names their source."
    )
    tokenize.add_argument("--output", required=True, help="The output folder or URL (one subfolder per source).")
    tokenize.add_argument(
        "--tokenizer",
        required=True,
        help="A tokenizer.json file (tokenizers), a folder a transformers tokenizer was saved to, or a cached name.",
    )
    tokenize.add_argument(
        "--vocab-size", type=int, help="The model's embedding rows: refuse a tokenizer with more token ids."
    )
    tokenize.add_argument(
        "-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[], help=STORAGE_OPTION_HELP
    )
    tokenize.add_argument("--text-column", default="text", help="The column of each document's text (default text).")
    tokenize.add_argument("--id-column", help="An integer column to keep as document_id (default: file and row).")
    tokenize.add_argument("--max-tokens", type=int, help="Cut longer documents to this many tokens (counted).")
    tokenize.add_argument("--eos", help="A token to append to every document, e.g. '<|endoftext|>'.")
    tokenize.add_argument(
        "--layout",
        default="flat",
        choices=["flat", "documents"],
        help="flat (default: tokens end to end plus document lengths, PackedTokens' fast read) or documents "
        "(one list row per document, for other Parquet tools).",
    )
    tokenize.add_argument(
        "--compression", help="The shards' Parquet codec (default: none for flat, snappy for documents)."
    )
    tokenize.set_defaults(_parser=tokenize)


def _add_pack(commands: Any) -> None:
    pack = commands.add_parser(
        "pack",
        help="Pack token Parquet (tokenize's output) into seq_len sequences once, offline, for PackedTokens.",
        formatter_class=_formatter,
        description=(
            "Pack the token documents of TOKENS (a folder of tokenize's output) into the exact sequences PackedTokens\n"
            "would pack on the fly for these options (the same pack windows, the same placement), written to OUTPUT\n"
            "in the packed layout; PackedTokens(OUTPUT, seq_len=N, policy=P) then reads them with no packing work.\n"
            "Worth it for best_fit (its placement costs more than the rest of the data path). Resumable (finished\n"
            "shards are kept) and idempotent (a rerun writes nothing). See data/ray/pack_tokens.py."
        ),
    )
    pack.add_argument("tokens", metavar="TOKENS", help="The token folder, file(s) or glob (one source).")
    pack.add_argument("output", metavar="OUTPUT", help="The output folder or URL.")
    pack.add_argument("--seq-len", type=int, required=True, help="Tokens per packed sequence.")
    pack.add_argument(
        "--policy", default="best_fit", choices=["best_fit", "concat"], help="Packing policy (default best_fit)."
    )
    pack.add_argument(
        "--window-tokens", type=int, help="Tokens per pack window (default 256 * seq_len, as PackedTokens)."
    )
    pack.add_argument("--pad-id", type=int, default=0, help="The token of padding (default 0).")
    pack.add_argument("--workers", type=int, default=4, help="Threads packing shards at once (default 4).")
    pack.add_argument(
        "-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[], help=STORAGE_OPTION_HELP
    )
    pack.set_defaults(_parser=pack)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--storage-option", action="append", metavar="KEY=VALUE", default=[], help=STORAGE_OPTION_HELP
    )
    parser.add_argument("--json", action="store_true", help="Print machine-readable JSON instead of a table.")


def _dispatch(args: argparse.Namespace) -> int:
    from raytrain_events.cli import runs  # why here: runs imports fsspec; --help and train start without it

    if args.command == "train":
        return run_train(args)
    if args.command == "tokenize":
        return _tokenize(args)
    if args.command == "pack":
        return _pack(args)
    options = runs.parse_storage_options(args.storage_option)
    if args.command == "runs":
        found = runs.list_runs(args.storage, options)
        print(json.dumps(found, indent=2, default=str) if args.json else runs.format_runs(found, args.storage))
        return 0
    if args.command == "inspect":
        info = runs.inspect_run(args.run_url, options)
        print(json.dumps(info, indent=2, default=str) if args.json else runs.format_inspect(info))
        return 0
    if args.command == "export":
        summary = export_checkpoint(
            args.checkpoint,
            args.output,
            storage_options=options,
            model_only=args.model_only,
            fmt=args.format,
            hf_config=args.hf_config,
        )
        print(
            json.dumps(summary)
            if args.json
            else f"Wrote {summary['output']} ({summary['tensors']} model tensors, "
            f"{summary['bytes']} bytes) from {summary['source']}"
        )
        return 0
    if args.command == "diff":
        text = runs.diff_runs(args.run_a, args.run_b, options)
        print(text if text else f"No differences between the configs of {args.run_a} and {args.run_b}.")
        return 1 if (text and args.exit_code) else 0
    if args.command == "ledger":
        return run_ledger(args, options)
    if args.command == "report":
        from raytrain_events.report import write_report  # why here: report/ imports fsspec (storage/)

        try:
            written = write_report(args.run_dir, options, metric=args.metric, mode=args.mode)
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None
        print(f"Wrote {written['html']} ({len(written['images'])} figures)")
        return 0
    raise UsageError(f"Unknown command {args.command!r}.")  # pragma: no cover - argparse rejects it first


def _tokenize(args: argparse.Namespace) -> int:
    # why here: they import fsspec and numpy, which only this command needs
    from raytrain_events.cli.runs import parse_storage_options
    from raytrain_events.data.ray.tokenize import tokenize

    sources: Dict[str, List[str]] = {}
    for item in args.inputs:
        name, _, path = item.rpartition("=") if "=" in item else ("train", "", item)
        sources.setdefault(name, []).append(path)
    return _print_summary(
        lambda: tokenize(
            sources,
            args.output,
            tokenizer=args.tokenizer,
            text_column=args.text_column,
            id_column=args.id_column,
            max_tokens=args.max_tokens,
            eos=args.eos,
            vocab_size=args.vocab_size,
            layout=args.layout,
            compression=args.compression,
            storage_options=parse_storage_options(args.storage_option) or None,
        )
    )


def _pack(args: argparse.Namespace) -> int:
    # why here: they import fsspec, numpy and pyarrow, which only this command needs
    from raytrain_events.cli.runs import parse_storage_options
    from raytrain_events.data.ray.pack_tokens import pack_tokens

    return _print_summary(
        lambda: pack_tokens(
            args.tokens,
            args.output,
            seq_len=args.seq_len,
            policy=args.policy,
            window_tokens=args.window_tokens,
            pad_id=args.pad_id,
            workers=args.workers,
            storage_options=parse_storage_options(args.storage_option) or None,
        )
    )


def _print_summary(job: Callable[[], Any]) -> int:
    """Run a data command's ``job`` and print its summary as JSON; bad input (a missing file, a refused option, a
    tokenizer that cannot load) is a usage error naming the problem, not a traceback."""
    try:
        summary = job()
    except (FileNotFoundError, FileExistsError, TypeError, ValueError, ImportError) as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    entry = None
    if argv[:1] == ["train"]:
        entry, rest = split_entry(argv[1:])
        argv = ["train"] + rest
    args = build_parser(entry).parse_args(argv)
    args.entry = entry
    return run_guarded(lambda: _dispatch(args), prog=PROG)
