"""``raytrain-events ledger RUN --checkpoint C --row SOURCE:N``: was that row trained before the
checkpoint, and how many times (`raytrain_events.core.ledger`: from the checkpoint's Timestamp, the
mixture's order and the `SpikeGuard`'s skip list; nothing per row is stored or read)."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from raytrain_events.cli.errors import UsageError
from raytrain_events.core.ledger import ledger_of_checkpoint
from raytrain_events.core.quarantine import Quarantine

__all__ = ["ask_ledger", "export_quarantine", "parse_row", "run_ledger"]


def run_ledger(args: Any, options: Dict[str, Any]) -> int:
    """``raytrain-events ledger``: ``--export-quarantine`` and/or ``--row``; prints the answer (``--json``: as JSON)."""
    if args.export_quarantine is not None:
        held = export_quarantine(args.run_url, args.checkpoint, args.export_quarantine, options)
        print(f"Wrote {held} quarantined rows to {args.export_quarantine}.")
        if args.row is None:
            return 0
    if args.row is None:
        raise UsageError("Pass --row SOURCE:N (or --export-quarantine FILE).")
    answer = ask_ledger(args.run_url, args.checkpoint, args.row, options)
    print(json.dumps(answer) if args.json else answer["line"])
    return 0


def parse_row(text: str) -> tuple[str, int]:
    """``SOURCE:N`` -> ``(source, N)``; a plain run's one source is ``train``."""
    source, sep, number = text.rpartition(":")
    if not sep or not source or not number.isdigit():
        raise UsageError(f"--row {text!r} is not SOURCE:N (a source name and a row number), e.g. --row web:1234.")
    return source, int(number)


def ask_ledger(
    run_url: str, checkpoint: Optional[str], row: str, storage_options: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The answer for ``row`` at ``checkpoint`` (a name under the run's ``checkpoints/``, a URL, or None: the newest)."""
    source, number = parse_row(row)
    info, state = _checkpoint_state(run_url, checkpoint, dict(storage_options or {}))
    try:
        answer = ledger_of_checkpoint(state).ask(source, number)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return {
        "checkpoint": info.url,
        "source": answer.source,
        "row": answer.row,
        "trained": answer.trained,
        "times": answer.times,
        "epochs": list(answer.epochs),
        "skipped_in_epochs": list(answer.skipped),
        "quarantined_in_epochs": list(answer.quarantined),
        "line": answer.line(),
    }


def export_quarantine(
    run_url: str, checkpoint: Optional[str], path: str, storage_options: Optional[Dict[str, Any]] = None
) -> int:
    """Write the checkpoint's quarantine (the `SpikeGuard`'s) to ``path``, the file a later run passes as
    ``SpikeGuard(quarantine_from=path)``; the number of rows it holds."""
    import fsspec

    _, state = _checkpoint_state(run_url, checkpoint, dict(storage_options or {}))
    callbacks = state.get("callbacks") or {}
    guard = next((v for k, v in callbacks.items() if k.split("#")[0] == "SpikeGuard"), None)
    if guard is None or "quarantine" not in guard:
        raise UsageError(f"The checkpoint of {run_url} holds no SpikeGuard quarantine (SpikeGuard(row_key=...)).")
    quarantine = Quarantine.from_state_dict(guard["quarantine"])
    with fsspec.open(path, "w", **dict(storage_options or {})) as fh:
        fh.write(quarantine.dumps())
    return len(quarantine)


def _checkpoint_state(run_url: str, checkpoint: Optional[str], options: Dict[str, Any]) -> Any:
    """``(manifest info, saved State)`` of ``checkpoint`` (None: the run's newest)."""
    # why here: checkpoint/ imports torch and storage/ fsspec; the CLI's other commands start without them
    from raytrain_events.checkpoint.folder.store import latest_checkpoint
    from raytrain_events.checkpoint.format.manifest import CheckpointNotCommittedError
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files, read_manifest
    from raytrain_events.storage.run_dir import STATE_FILE, RunDir

    run = RunDir(run_url, options)
    folder = run.checkpoints
    if checkpoint is None:
        info = latest_checkpoint(folder, storage_options=options)
        if info is None:
            raise UsageError(f"No committed checkpoint under {folder}: pass --checkpoint with a checkpoint's URL.")
    else:
        url = checkpoint if ("/" in checkpoint or "://" in checkpoint) else run.checkpoint(checkpoint)
        try:
            info = read_manifest(url, storage_options=options)
        except (FileNotFoundError, CheckpointNotCommittedError):
            raise UsageError(
                f"No checkpoint at {url}: `raytrain-events inspect {run_url}` lists the run's checkpoints."
            ) from None
    return info, read_checkpoint_files(info, storage_options=options, files=[STATE_FILE]).files[STATE_FILE]
