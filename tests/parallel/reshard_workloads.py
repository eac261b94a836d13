"""Rank functions for the sharded-load read-cost tests and bench (importable by spawned ranks).

An FSDP2 run of `make_model(width)` with AdamW and EMA saves one sharded checkpoint; a run on
another number of ranks autoresumes from it while `count_reads` counts what it reads. The local tier's
(``tier_save``/``tier_load``): each rank on its own node-local directory, S3 reads counted.
"""

from __future__ import annotations

from typing import Any, Dict, List

from raytrain_events import Trainer
from tests.parallel.io_count import count_reads, count_s3_reads
from tests.parallel.workloads import _full, make_loader, make_model, snapshot

FSDP = {"shard_modules": ["Block"]}


def wide_trainer(  # noqa: PLR0913
    rank: int,
    folder: str,
    width: int,
    autoresume: bool,
    storage_options: Any = None,
    local_dir: Any = None,
    parallelism: Any = FSDP,
) -> Trainer:
    """FSDP (or ``parallelism``) over 3 Blocks of ``width`` x ``width`` (plus a small head), AdamW and EMA: 4
    tensors (weight, 2 Adam moments, EMA average) of ``4 * width**2`` bytes per Block in the checkpoint."""
    import torch

    from raytrain_events.algorithms.ema import EMA
    from raytrain_events.checkpoint import CheckpointConfig

    model = make_model(width=width)
    return Trainer(
        model=model,
        train_dataloader=make_loader(rank, n=16, width=width),
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=0.05),
        parallelism=parallelism,
        algorithms=[EMA(smoothing=0.5)],
        checkpoint=CheckpointConfig(
            save_folder=folder,
            save_interval="2ba",
            lock_run_dir=False,
            save_every_n_seconds=None,
            autoresume=autoresume,
            async_save=False,
            storage_options=dict(storage_options or {}),
            local_dir=local_dir,
        ),
    )


def _state(trainer: Trainer) -> Dict[str, Any]:
    out = snapshot(trainer)
    out["ema"] = _full(trainer.state.algorithms[0].state_dict()["shadow"])
    return out


def wide_save(rank: int, world_size: int, folder: str, width: int, storage_options: Any = None) -> Dict[str, Any]:
    """Train 2 batches and save once; the final state as full tensors."""
    trainer = wide_trainer(rank, folder, width, False, storage_options)
    trainer.fit()
    out = _state(trainer)
    trainer.close()
    return out


def wide_load(rank: int, world_size: int, folder: str, width: int, storage_options: Any = None) -> Dict[str, Any]:
    """Autoresume from ``folder``, counting reads; the loaded state as full tensors and the counts."""
    with count_reads() as counts:
        trainer = wide_trainer(rank, folder, width, True, storage_options)
    out = _state(trainer)
    out["counts"] = counts.as_dict()
    out["loaded"] = trainer._checkpointer.loaded.name
    trainer.close()
    return out


def wide_load_error(rank: int, world_size: int, folder: str, width: int) -> str:
    """Autoresume from ``folder``, expecting an error: ``"<type>: <message>"``."""
    try:
        wide_trainer(rank, folder, width, True).close()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def tier_save(rank: int, world_size: int, folder: str, width: int, options: Any, nodes: List[str]) -> Dict[str, Any]:
    """`wide_save` with the local tier: rank r's node-local directory is ``nodes[r]``."""
    trainer = wide_trainer(rank, folder, width, False, options, local_dir=nodes[rank])
    trainer.fit()
    out = _state(trainer)
    trainer.close()
    return out


def tier_load(rank: int, world_size: int, folder: str, width: int, options: Any, nodes: List[str]) -> Dict[str, Any]:
    """Autoresume with rank r on ``nodes[r]``, counting the bytes each S3 object served."""
    with count_s3_reads() as counts:
        trainer = wide_trainer(rank, folder, width, True, options, local_dir=nodes[rank])
    out = _state(trainer)
    out["s3"] = dict(counts)
    trainer.close()
    return out


def full_tier_save(
    rank: int, world_size: int, folder: str, width: int, options: Any, nodes: List[str]
) -> Dict[str, Any]:
    """`tier_save` under DDP: a full checkpoint, whose ``state.pt`` rank 0 alone writes (into ``nodes[0]``)."""
    trainer = wide_trainer(rank, folder, width, False, options, local_dir=nodes[rank], parallelism="ddp")
    trainer.fit()
    out = _state(trainer)
    trainer.close()
    return out


def full_tier_load(
    rank: int, world_size: int, folder: str, width: int, options: Any, nodes: List[str]
) -> Dict[str, Any]:
    """`tier_load` under DDP: autoresume with rank r on ``nodes[r]``, counting the bytes each S3 object served."""
    with count_s3_reads() as counts:
        trainer = wide_trainer(rank, folder, width, True, options, local_dir=nodes[rank], parallelism="ddp")
    out = _state(trainer)
    out["s3"] = dict(counts)
    trainer.close()
    return out
