"""Rank functions for context parallelism (importable by spawned ranks).

The model is the example transformer (examples/transformer_lm.py), whose attention is plain SDPA.
The ranks of a CP group load the same rows (data sharded by ``rank // group``); the DDP reference
arm feeds those same rows to every rank of the group, whole, so both train on the same global batches.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.utils.data import DataLoader

from raytrain_events import Trainer
from raytrain_events.core.callback import Callback
from raytrain_events.core.data_spec import DataSpec

CP_ARMS: Dict[str, Any] = {
    "ddp": "ddp",  # the reference: every rank of a group trains the group's whole rows
    "ddp_pairs": "ddp",  # the same, for groups of 2 when another arm of the run has groups of 4
    "cp": {"shard_modules": ["Block"], "context_parallel": 2},
    "cp_tp": {"shard_modules": ["Block"], "context_parallel": 2, "tensor_parallel": 2},
    "hsdp_cp": {"shard_modules": ["Block"], "replicate": 2, "context_parallel": 2},  # (2, 1, 2, 1) on 4 ranks
}


class Record(Callback):
    """Each batch's loss (this rank's) and, after the first batch's backward, the full gradients."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.grads: Dict[str, torch.Tensor] = {}
        self.lengths: List[int] = []

    def before_forward(self, state: Any, logger: Any) -> None:
        self.lengths.append(int(state.batch["input_ids"].shape[1]))

    def after_train_batch(self, state: Any, logger: Any) -> None:
        self.losses.append(float(state.loss))
        if not self.grads:
            for name, param in state.model.named_parameters():
                grad = param.grad
                self.grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def counted_lm() -> Any:
    """The transformer with two eval metrics: rows seen (a sum) and the loss (a mean)."""
    from torchmetrics import MeanMetric, SumMetric

    from examples.transformer_lm import TransformerLM

    class Counted(TransformerLM):
        def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
            return {} if is_train else {"rows": SumMetric(), "loss": MeanMetric()}

        def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Any) -> None:
            if isinstance(metric, SumMetric):
                metric.update(float(len(batch["input_ids"])))
            else:
                metric.update(self.loss(outputs, batch).detach())

    return Counted()


def cp_trainer(rank: int, parallelism: Any, group: int, callbacks: Any = (), batches: int = 4) -> Trainer:
    """The transformer (sequence 16) with AdamW and grad accumulation 2, tokens counted; data shard ``rank // group``."""
    from examples.transformer_lm import random_tokens

    torch.manual_seed(0)
    model = counted_lm()
    loader = DataLoader(random_tokens(8 * batches, seed=100 + rank // group), batch_size=8)
    return Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=lambda b: int(b["input_ids"].numel())),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        grad_accum=2,
        parallelism=parallelism,
        callbacks=list(callbacks),
    )


def train_cp(rank: int, world_size: int, arms: Any, group: Any) -> Dict[str, Any]:
    """Each arm trains 4 batches: losses, first-batch gradients, final full parameters, the Timestamp;
    then evaluates 12 rows (whole, unsplit). ``group``: ranks per group (loading the same rows), one
    number for every arm or a dict by arm."""
    from examples.transformer_lm import random_tokens
    from tests.parallel.workloads import full_model_state

    out: Dict[str, Any] = {}
    for name in arms:
        record = Record()
        trainer = cp_trainer(rank, CP_ARMS[name], group[name] if isinstance(group, dict) else group, [record])
        trainer.fit()
        evaluated = trainer.eval(DataLoader(random_tokens(12, seed=7), batch_size=4))  # the same rows on every rank
        out[name] = {
            "eval": {k.rsplit("/", 1)[-1]: float(v) for k, v in evaluated.items()},
            "losses": record.losses,
            "grads": record.grads,
            "lengths": record.lengths,
            "model": full_model_state(trainer.state.model),
            "timestamp": trainer.state.timestamp.state_dict(),
        }
        trainer.close()
    return out
