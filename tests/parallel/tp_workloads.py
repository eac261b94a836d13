"""Rank functions for tensor parallelism (FSDP x TP) and the reshard matrix (importable by spawned ranks).

The model is the example transformer (examples/transformer_lm.py). Under TP the ``t`` ranks of a
tensor group load the same batches: data is sharded by the data-parallel rank ``rank // t``, and
the DDP reference arm (``lm_ddp2``) shards it the same way, so both train on the same global batches.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.algorithms.gradient_clipping import GradientClipping
from tests.parallel.workloads import ARMS, checkpointed_trainer, snapshot

LM_ARMS: Dict[str, Any] = {
    "lm_ddp2": "ddp",  # the reference for 2-way TP: DDP with each pair of ranks on one data shard
    "lm_tp": {"shard_modules": ["Block"], "tensor_parallel": 2},  # FSDP x TP 2x2 on 4 ranks
    "lm_fsdp": {"shard_modules": ["Block"]},
    # HSDP x TP 2x1x2 on 4 ranks: a (replicate, shard, tensor) mesh
    "lm_hsdp_tp": {"shard_modules": ["Block"], "replicate": 2, "tensor_parallel": 2},
}


def lm_trainer(
    rank: int,
    parallelism: Any,
    max_duration: str = "5ba",
    data_group: int = 1,
    folder: Optional[str] = None,
    **ckpt: Any,
) -> Trainer:
    """The transformer with AdamW, grad accumulation 2 and norm clipping (threshold 0.1); the data
    shard is ``rank // data_group`` (the data-parallel rank when ``data_group`` is the TP degree)."""
    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events.checkpoint import CheckpointConfig

    torch.manual_seed(0)  # the same initial weights on every rank and for every strategy
    model = TransformerLM()
    checkpoint = None
    if folder is not None:
        config = dict(save_folder=folder, save_interval="3ba", lock_run_dir=False, save_every_n_seconds=None)
        config.update(ckpt)
        checkpoint = CheckpointConfig(**config)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(48, seed=100 + rank // data_group), batch_size=8),
        max_duration=max_duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        grad_accum=2,
        parallelism=parallelism,
        algorithms=[GradientClipping("norm", 0.1)],
        checkpoint=checkpoint,
    )


def train_lm(rank: int, parallelism: Any, data_group: int) -> Dict[str, Any]:
    """One arm of the FSDP x TP vs DDP comparison: final full parameters, last norm, samples seen."""
    from tests.parallel.workloads import full_model_state

    trainer = lm_trainer(rank, parallelism, data_group=data_group)
    trainer.fit()
    params = list(trainer.state.model.parameters())
    return {
        "model": full_model_state(trainer.state.model),
        "norm": float(trainer.state.algorithms[0].last_grad_norm),
        "samples": trainer.state.timestamp.sample.value,
        "mesh_dims": sorted({p.device_mesh.ndim for p in params if type(p).__name__ == "DTensor"}),
    }


def _resume(rank: int, parallelism: Any, folder: str, data_group: int) -> Dict[str, Any]:
    """Autoresume from ``folder`` at batch 4 (its snapshot as loaded), train a 5th batch and save it (its snapshot)."""
    trainer = lm_trainer(rank, parallelism, "5ba", data_group, folder, autoresume=True, save_interval="1ba")
    loaded = snapshot(trainer)
    trainer.fit()
    saved = snapshot(trainer)
    trainer.close()
    return {"loaded": loaded, "saved": saved}


def reshard_matrix_four(
    rank: int, world_size: int, hsdp_folder: str, tp_folder: str, ddp1_folder: str, cp_folder: str
) -> Dict[str, Any]:
    """The 4-rank part of the reshard matrix, in one spawn: HSDP 2x2 trains 4 batches and saves;
    FSDP x TP 2x2 trains 4 batches and saves; FSDP 4 loads that, trains a 5th batch and saves;
    FSDP x TP 2x2 loads the 5th-batch checkpoint (its snapshot as loaded). Every save is mid-epoch
    (6 batches per epoch), so the state after ``fit`` is the last checkpoint's. Then the HSDP x TP
    2x1x2 hops (`hsdp_tp_hops`) and the CP x TP 2x2 ones (`cp_tp_hops`)."""
    hsdp = checkpointed_trainer(rank, ARMS["hsdp"], hsdp_folder, "4ba", save_interval="2ba")
    hsdp.fit()
    out: Dict[str, Any] = {"hsdp_saved": snapshot(hsdp)}
    hsdp.close()
    tp = LM_ARMS["lm_tp"]
    trainer = lm_trainer(rank, tp, "4ba", 2, tp_folder, save_interval="2ba")
    trainer.fit()
    out["tp_saved"] = snapshot(trainer)
    trainer.close()
    out["fsdp4"] = _resume(rank, LM_ARMS["lm_fsdp"], tp_folder, 1)
    back = lm_trainer(rank, tp, "5ba", 2, tp_folder, autoresume=True)
    out["tp_loaded"] = snapshot(back)
    out["tp_loaded_mesh_dims"] = sorted(
        {p.device_mesh.ndim for p in back.state.model.parameters() if type(p).__name__ == "DTensor"}
    )
    back.close()
    out["hsdp_tp"] = hsdp_tp_hops(rank, ddp1_folder, tp_folder)
    out["cp_tp"] = cp_tp_hops(rank, tp_folder, cp_folder)
    return out


def ddp1_save_lm(folder: str) -> Dict[str, Any]:
    """DDP on one process (the test's own) trains the transformer 4 batches and saves at 2 and 4;
    its final snapshot (HSDP x TP loads that checkpoint in `reshard_matrix_four`)."""
    trainer = lm_trainer(0, "ddp", "4ba", 1, folder, save_interval="2ba")
    trainer.fit()
    out = snapshot(trainer)
    trainer.close()
    return out


def _mesh_dims(trainer: Trainer) -> list:
    return sorted({p.device_mesh.ndim for p in trainer.state.model.parameters() if type(p).__name__ == "DTensor"})


def hsdp_tp_hops(rank: int, ddp1_folder: str, tp_folder: str) -> Dict[str, Any]:
    """DDP 1 -> HSDP x TP 2x1x2 (load only); FSDP 4's batch-5 checkpoint -> HSDP x TP, which trains a
    6th batch and saves it -> FSDP 4 (load only). The test process then loads that save on DDP 1."""
    hsdp_tp = LM_ARMS["lm_hsdp_tp"]
    trainer = lm_trainer(rank, hsdp_tp, "4ba", 2, ddp1_folder, autoresume=True)
    out: Dict[str, Any] = {"from_ddp1": snapshot(trainer)}
    trainer.close()
    trainer = lm_trainer(rank, hsdp_tp, "6ba", 2, tp_folder, autoresume=True, save_interval="1ba")
    out["from_fsdp4"], out["mesh_dims"] = snapshot(trainer), _mesh_dims(trainer)
    trainer.fit()
    out["saved"] = snapshot(trainer)
    trainer.close()
    trainer = lm_trainer(rank, LM_ARMS["lm_fsdp"], "6ba", 1, tp_folder, autoresume=True)
    out["fsdp4_loaded"] = snapshot(trainer)
    trainer.close()
    return out


def cp_tp_hops(rank: int, tp_folder: str, cp_folder: str) -> Dict[str, Any]:
    """CP x TP 2x2 (FSDP over shard x context, flattened) starts from the newest checkpoint in
    ``tp_folder`` (HSDP x TP's, batch 6; its snapshot as loaded), trains a 7th batch with each
    sequence split and saves it in ``cp_folder`` (the test process then loads that on DDP 1)."""
    cp_tp = {"shard_modules": ["Block"], "context_parallel": 2, "tensor_parallel": 2}
    trainer = lm_trainer(rank, cp_tp, "7ba", 4, cp_folder, load_from=tp_folder, save_interval="1ba")
    out: Dict[str, Any] = {"loaded": snapshot(trainer)}
    trainer.fit()
    out["saved"] = snapshot(trainer)
    trainer.close()
    return out


def hsdp_to_fsdp3(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """FSDP on 3 ranks loads the HSDP 2x2 checkpoint, trains a 5th batch and saves it."""
    trainer = checkpointed_trainer(
        rank, {"shard_modules": ["Block"]}, folder, "5ba", autoresume=True, save_interval="1ba"
    )
    loaded = snapshot(trainer)
    trainer.fit()
    saved = snapshot(trainer)
    trainer.close()
    return {"loaded": loaded, "saved": saved}


def tp_with_per_rank_data(rank: int, world_size: int) -> str:
    """FSDP x TP 1x2 fed per-rank data (the mistake): the error every rank raises, or "no error"."""
    trainer = lm_trainer(rank, {"tensor_parallel": 2}, "1ba", data_group=1)
    try:
        trainer.fit()
    except ValueError as e:
        return str(e)
    return "no error"


def tp_eval_counts(rank: int, world_size: int) -> Dict[str, float]:
    """FSDP x TP 1x2 evaluates 12 rows that both ranks of the group see: a sum metric (rows) and a
    mean metric (the loss) as every rank computes them."""
    from torchmetrics import MeanMetric, SumMetric

    from examples.transformer_lm import TransformerLM, random_tokens

    class Counted(TransformerLM):
        def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
            return {"rows": SumMetric(), "loss": MeanMetric()}

        def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Any) -> None:
            if isinstance(metric, SumMetric):
                metric.update(float(len(batch["input_ids"])))
            else:
                metric.update(self.loss(outputs, batch).detach())

    torch.manual_seed(0)
    model = Counted()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(8, seed=100), batch_size=4),
        max_duration="1ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        parallelism={"shard_modules": ["Block"], "tensor_parallel": 2},
    )
    trainer.fit()
    values = trainer.eval(DataLoader(random_tokens(12, seed=7), batch_size=4))
    trainer.close()
    return {k.rsplit("/", 1)[-1]: float(v) for k, v in values.items()}
