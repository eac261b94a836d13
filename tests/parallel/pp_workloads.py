"""Rank functions for pipeline parallelism (importable by spawned ranks).

The model is the example transformer (examples/transformer_lm.py) with 4 blocks, built on the meta
device. The ``p`` stages of a pipeline (consecutive ranks) load the same batches: the data shard is
``rank // data_group``; the DDP reference on 2 ranks shards it by rank, so both train on the same
global batches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.algorithms.gradient_clipping import GradientClipping
from raytrain_events.core.callback import Callback
from tests.parallel.workloads import full_model_state, snapshot

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs")
COUNTED = (
    "BEFORE_FORWARD",
    "AFTER_FORWARD",
    "BEFORE_LOSS",
    "AFTER_LOSS",
    "BEFORE_BACKWARD",
    "AFTER_BACKWARD",
    "BATCH_END",
)


class EventCounter(Callback):
    """Counts the per-batch and per-microbatch events this rank fires, and what the loss was at BATCH_END."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        self.losses: List[float] = []

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        if event.name in COUNTED:
            self.counts[event.name] = self.counts.get(event.name, 0) + 1
        if event.name == "BATCH_END":
            self.losses.append(float(state.loss))


def pp_config(schedule: str, degree: int = 2, **more: Any) -> Dict[str, Any]:
    """FSDP x PP: each block its own FSDP unit; 2 microbatches."""
    return {
        "shard_modules": ["Block"],
        "pipeline_parallel": degree,
        "pipeline_schedule": schedule,
        "pipeline_microbatches": 2,
        **more,
    }


def pp_trainer(
    rank: int,
    parallelism: Any,
    max_duration: str = "4ba",
    data_group: int = 1,
    folder: Optional[str] = None,
    meta: bool = True,
    **ckpt: Any,
) -> Trainer:
    """The 4-block transformer (on meta when ``meta``) with AdamW and norm clipping (threshold 0.1,
    so the whole model's norm decides every step); DDP runs 2 microbatches as the pipelines do."""
    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events.checkpoint import CheckpointConfig

    torch.manual_seed(0)  # the same initial weights on every rank and for every layout
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = TransformerLM(depth=4)
    checkpoint = None
    if folder is not None:
        config = dict(save_folder=folder, save_interval="2ba", lock_run_dir=False, save_every_n_seconds=None)
        config.update(ckpt)
        checkpoint = CheckpointConfig(**config)
    pipelined = isinstance(parallelism, dict) and parallelism.get("pipeline_parallel", 1) > 1
    return Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(32, seed=100 + rank // data_group), batch_size=8),
        max_duration=max_duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        grad_accum=1 if pipelined else 2,
        parallelism=parallelism,
        algorithms=[GradientClipping("norm", 0.1)],
        callbacks=[EventCounter()],
        checkpoint=checkpoint,
    )


def _result(trainer: Trainer) -> Dict[str, Any]:
    state = trainer.state
    return {
        "model": full_model_state(state.model),
        "norm": float(state.algorithms[0].last_grad_norm),
        "loss": float(state.loss),
        "samples": state.timestamp.sample.value,
        "batches": state.timestamp.batch.value,
        "events": state.callbacks[0].counts,
        "losses": state.callbacks[0].losses,
    }


def train_ddp(rank: int, world_size: int) -> Dict[str, Any]:
    """The reference: DDP on 2 ranks, one data shard each."""
    trainer = pp_trainer(rank, "ddp", meta=False)
    trainer.fit()
    return _result(trainer)


def train_schedules(rank: int, world_size: int, configs: List[Dict[str, Any]], data_group: int) -> List[Dict[str, Any]]:
    """Each config in turn on the same ranks; a result each (this rank's stage's full parameters)."""
    out = []
    for config in configs:
        trainer = pp_trainer(rank, config, data_group=data_group)
        trainer.fit()
        result = _result(trainer)
        pipeline = trainer.parallel.pipeline
        assert pipeline is not None
        result["stages"] = pipeline.stage_indices
        result["local_numel"] = sum(p.to_local().numel() for p in trainer.state.model.parameters())
        out.append(result)
        trainer.close()
    return out


def pp_checkpoint_hops(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """PP 2 x DP 2 (1F1B, 2 stages of 2 blocks) trains 2 batches and saves; PP 4 (4 stages of one
    block, one pipeline over the 4 ranks) resumes it (its snapshot as loaded), trains a 3rd batch
    and saves it into the same folder (the test process resumes that on one process)."""
    pp2 = pp_config("1f1b")
    trainer = pp_trainer(rank, pp2, "2ba", 2, folder)
    trainer.fit()
    out: Dict[str, Any] = {"pp2_saved": snapshot(trainer)}
    trainer.close()
    pp4 = pp_config("1f1b", degree=4, pipeline_microbatches=4)
    trainer = pp_trainer(rank, pp4, "3ba", 4, folder, autoresume=True, save_interval="1ba")
    out["pp4_loaded"] = snapshot(trainer)
    trainer.fit()
    out["pp4_saved"] = snapshot(trainer)
    trainer.close()
    return out
