"""``raytrain-events export``: one consolidated ``state.pt`` from a (sharded or full) checkpoint.

A sharded checkpoint (FSDP, ``layout: dcp``) is read in one process through the safe DCP reader
and written as a single ``torch.save`` file with full tensors: ``model`` (a plain
``state_dict`` for ``model.load_state_dict``), ``optim`` (optimizer state by parameter name),
and the rest of the training state (Timestamp, schedulers, algorithms). ``--model-only`` keeps
just ``{"model": ...}``, for inference. ``fmt="safetensors"`` writes the model as a Hugging
Face-style safetensors directory instead, one tensor at a time (``checkpoint/dcp/safetensors_io.py``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["export_checkpoint"]


def export_checkpoint(  # noqa: PLR0913 (what, where, then keyword-only export options)
    checkpoint_url: str,
    output_url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    model_only: bool = False,
    fmt: str = "pt",
    hf_config: Optional[str] = None,
) -> Dict[str, Any]:
    """Write ``output_url`` (a file path or URL; a directory for safetensors); returns a summary
    (source, tensors, bytes)."""
    if fmt not in ("pt", "safetensors"):
        raise ValueError(f"--format {fmt!r} is not supported: use 'pt' (one state.pt) or 'safetensors' (a directory).")
    if hf_config is not None and fmt != "safetensors":
        raise ValueError("--hf-config goes with --format safetensors (the config.json of a Hugging Face directory).")
    # why here: checkpoint/ imports torch and storage/ fsspec; the CLI's other commands start without them
    from raytrain_events.checkpoint.dcp.sharded import is_sharded_checkpoint, load_consolidated
    from raytrain_events.checkpoint.folder.store import latest_checkpoint
    from raytrain_events.checkpoint.format.manifest import CheckpointNotCommittedError
    from raytrain_events.checkpoint.format.reader import read_checkpoint_files, read_manifest
    from raytrain_events.checkpoint.format.writer import serialize
    from raytrain_events.storage.fs import resolve, write_bytes_atomic
    from raytrain_events.storage.run_dir import STATE_FILE

    options = dict(storage_options or {})
    try:
        info = read_manifest(checkpoint_url, storage_options=options)
    except CheckpointNotCommittedError:
        info = latest_checkpoint(checkpoint_url, storage_options=options)  # a folder of checkpoints
        if info is None:
            raise FileNotFoundError(
                f"{checkpoint_url!r} is neither a committed checkpoint nor a folder holding one. Fix: point at a "
                "checkpoint directory (with manifest.json) or the run's checkpoints/ folder."
            ) from None
    if fmt == "safetensors":  # the model only, streamed tensor by tensor
        # why here: defers torch.distributed.tensor (the safetensors export reads DTensor shards) to this format
        from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors

        return export_safetensors(info, output_url, storage_options=options, hf_config=hf_config)
    rest = read_checkpoint_files(info, storage_options=options, files=[STATE_FILE]).files[STATE_FILE]
    state = load_consolidated(info, rest, options) if is_sharded_checkpoint(info) else rest
    if model_only:
        state = {"model": state["model"]}
    data = serialize(state)
    fs, path = resolve(output_url, options)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    write_bytes_atomic(fs, path, data)
    return {"source": info.url, "output": output_url, "tensors": len(state["model"]), "bytes": len(data)}
