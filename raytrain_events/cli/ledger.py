"""``raytrain-events ledger RUN --checkpoint C --row SOURCE:N``: was that row trained before the
checkpoint, and how many times (`raytrain_events.core.ledger`: from the checkpoint's Timestamp, the
mixture's order and the `SpikeGuard`'s skip list; nothing per row is stored or read)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from raytrain_events.cli.errors import UsageError

__all__ = ["ask_ledger", "parse_row"]


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
    from raytrain_events.checkpoint.folder.store import latest_checkpoint
    from raytrain_events.checkpoint.format.manifest import CheckpointNotCommittedError
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files, read_manifest
    from raytrain_events.core.ledger import ledger_of_checkpoint
    from raytrain_events.storage.run_dir import STATE_FILE, RunDir

    source, number = parse_row(row)
    options = dict(storage_options or {})
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
    state = read_checkpoint_files(info, storage_options=options, files=[STATE_FILE]).files[STATE_FILE]
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
        "line": answer.line(),
    }
