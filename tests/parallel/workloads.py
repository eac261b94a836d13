"""Rank functions for the parallel tests (importable by spawned processes)."""

from __future__ import annotations

import functools
from typing import Any, Dict

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.algorithms.gradient_clipping import GradientClipping
from raytrain_events.models import ClassifierModel


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def make_model(width: int = 16, depth: int = 3, classes: int = 5) -> ClassifierModel:
    torch.manual_seed(0)  # the same initial weights on every rank and for every strategy
    layers = [Block(width) for _ in range(depth)] + [torch.nn.Linear(width, classes)]
    return ClassifierModel(torch.nn.Sequential(*layers), num_classes=classes)


def make_loader(rank: int, n: int = 48, width: int = 16, classes: int = 5, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    x = torch.randn(n, width, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def full_model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) model state on every rank, for comparisons."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def make_trainer(rank: int, parallelism: Any, max_duration: str = "6ba", **kwargs: Any) -> Trainer:
    model = make_model()
    kwargs.setdefault("algorithms", [GradientClipping("norm", 0.1)])
    return Trainer(
        model=model,
        train_dataloader=make_loader(rank),
        max_duration=max_duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=0.05),
        grad_accum=2,
        parallelism=parallelism,
        **kwargs,
    )


ARMS = {
    "ddp": "ddp",
    "fsdp": {"shard_modules": ["Block"]},
    "fsdp_root": "fsdp",  # one unit: the root
    "hsdp": {"shard_modules": ["Block"], "replicate": 2},  # 2 replica groups x (world / 2) shards
    "fsdp_ac": {"shard_modules": ["Block"], "activation_checkpointing": True, "reshard_after_forward": False},
}


def train_ddp_and_fsdp(rank: int, world_size: int, max_duration: str, arms: Any) -> Dict[str, Any]:
    """The same model and data under DDP and under FSDP (grad accumulation 2, clipping on), and
    with LayerFreezing and evaluation (global eval metrics) in the ``*_freeze`` arms."""
    from raytrain_events.algorithms.layer_freezing import LayerFreezing

    out: Dict[str, Any] = {}
    for name in arms:
        if name.startswith("lm_"):  # the transformer, FSDP x TP and its DDP reference (tp_workloads.py)
            from tests.parallel.tp_workloads import LM_ARMS, train_lm

            got = train_lm(rank, LM_ARMS[name], data_group=2)
            out[name], out[name + "_norm"] = got["model"], got["norm"]
            out[name + "_sharded"], out[name + "_samples"] = got["mesh_dims"], got["samples"]
            continue
        freeze = name.endswith("_freeze")
        parallelism = ARMS[name.removesuffix("_freeze")]
        extra: Dict[str, Any] = {}
        if freeze:
            extra = dict(
                algorithms=[GradientClipping("norm", 0.1), LayerFreezing(freeze_start=0.3, update_on="batch")],
                eval_dataloader=make_loader(50 + rank),
                eval_interval="3ba",
            )
        trainer = make_trainer(rank, parallelism, max_duration, **extra)
        trainer.fit()
        out[name] = full_model_state(trainer.state.model)
        out[name + "_norm"] = float(trainer.state.algorithms[0].last_grad_norm)
        out[name + "_sharded"] = any(type(p).__name__ == "DTensor" for p in trainer.state.model.parameters())
        if freeze:
            out[name + "_frozen"] = trainer.state.algorithms[1].num_frozen
            out[name + "_eval"] = {k: float(v.compute()) for k, v in trainer.state.eval_metrics["eval"].items()}
    return out


def full_optimizer_state(trainer: Trainer) -> Dict[str, Any]:
    """Optimizer state keyed by parameter name, full tensors (comparable across strategies)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(
        trainer.state.model, trainer.state.optimizers, options=StateDictOptions(full_state_dict=True)
    )
    return {
        f"{name}.{k}": v.detach().clone()
        for name, values in osd["state"].items()
        for k, v in values.items()
        if torch.is_tensor(v)
    }


def snapshot(trainer: Trainer) -> Dict[str, Any]:
    return {
        "model": full_model_state(trainer.state.model),
        "optim": full_optimizer_state(trainer),
        "timestamp": trainer.state.timestamp.state_dict(),
    }


def checkpointed_trainer(rank: int, parallelism: Any, folder: str, max_duration: str = "5ba", **ckpt: Any) -> Trainer:
    from raytrain_events.algorithms.ema import EMA
    from raytrain_events.checkpoint import CheckpointConfig

    config = dict(save_folder=folder, save_interval="3ba", lock_run_dir=False, save_every_n_seconds=None)
    config.update(ckpt)
    return make_trainer(
        rank,
        parallelism,
        max_duration,  # 5ba: saves at 3 and at the end (5), mid-epoch: the final state is the last checkpoint's
        algorithms=[GradientClipping("norm", 0.1), EMA(smoothing=0.5)],
        checkpoint=CheckpointConfig(**config),
    )


def train_and_save(rank: int, world_size: int, parallelism: Any, folder: str, **ckpt: Any) -> Dict[str, Any]:
    """Train 5 batches, saving at 3 and 5; the final state (full tensors) and the EMA average."""
    trainer = checkpointed_trainer(rank, parallelism, folder, **ckpt)
    trainer.fit()
    out = snapshot(trainer)
    out["ema"] = _full(trainer.state.algorithms[1].state_dict()["shadow"])
    return out


def load_only(rank: int, world_size: int, parallelism: Any, folder: str, **ckpt: Any) -> Dict[str, Any]:
    """Build a trainer that autoresumes from ``folder`` and report what it loaded."""
    trainer = checkpointed_trainer(rank, parallelism, folder, autoresume=True, **ckpt)
    out = snapshot(trainer)
    out["loaded"] = trainer._checkpointer.loaded.name
    ema = trainer.state.algorithms[1]
    ema_state = ema.state_dict()["shadow"]
    out["ema"] = _full(ema_state) if ema_state is not None else None
    out["ema_sharded"] = any(type(v).__name__ == "DTensor" for v in (ema_state or {}).values())
    trainer.close()
    return out


def _full(tree: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in tree.items()}


def save_then_crash(rank: int, world_size: int, folder: str) -> str:
    """Save at batch 3; the save at batch 5 fails on rank 1 half way through writing its shards."""
    from raytrain_events.checkpoint.dcp import safe_dcp

    original = safe_dcp._HashingStream.write
    calls = {"n": 0}

    def failing_write(self, data):
        if rank == 1 and trainer.state.timestamp.batch.value >= 5:
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError("disk full (injected)")
        return original(self, data)

    safe_dcp._HashingStream.write = failing_write
    trainer = checkpointed_trainer(rank, "fsdp", folder, save_final=True, async_save=False)
    try:
        trainer.fit()
    except Exception as e:  # every rank sees the failed save (DCP gathers write errors)
        return f"{type(e).__name__}: {e}"  # CheckpointError naming the failed rank
    return "no error"


def ddp_save_then_fsdp_load(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """A DDP run saves full checkpoints (state.pt); an FSDP run of the same ranks loads the last one
    and trains one more batch (EMA updates its average of the now sharded parameters)."""
    saved = train_and_save(rank, world_size, "ddp", folder)
    loaded = load_only(rank, world_size, {"shard_modules": ["Block"]}, folder)
    trainer = checkpointed_trainer(rank, {"shard_modules": ["Block"]}, folder, "6ba", autoresume=True)
    trainer.fit()
    ema = trainer.state.algorithms[1].state_dict()["shadow"]
    return {
        "saved": saved,
        "loaded": loaded,
        "continued_batch": trainer.state.timestamp.batch.value,
        "continued_ema_sharded": any(type(v).__name__ == "DTensor" for v in ema.values()),
    }


MIXED_ARMS = {
    "ddp": "ddp",
    "bf16": {"shard_modules": ["Block"], "param_dtype": "bf16", "reduce_dtype": "fp32"},
    "offload": {"shard_modules": ["Block"], "cpu_offload": True},
}


def _record_dtypes(seen: set, module: torch.nn.Module, inputs: Any) -> None:
    seen.add((str(inputs[0].dtype), str(module.weight.dtype)))


def train_mixed_precision_and_offload(rank: int, world_size: int) -> Dict[str, Any]:
    """DDP, FSDP with bf16 compute (fp32 reductions) and FSDP with CPU offload on the same model and
    data; records the dtypes the Linear layers computed in and the dtypes of the kept parameters."""
    out: Dict[str, Any] = {}
    for name, parallelism in MIXED_ARMS.items():
        trainer = make_trainer(rank, parallelism, "6ba")
        seen: set = set()
        for module in trainer.state.model.modules():
            if type(module) is torch.nn.Linear:
                module.register_forward_pre_hook(functools.partial(_record_dtypes, seen))
        trainer.fit()
        out[name] = full_model_state(trainer.state.model)
        out[name + "_compute"] = sorted(seen)
        out[name + "_kept"] = sorted({str(p.dtype) for p in trainer.state.model.parameters()})
        out[name + "_devices"] = sorted({p.device.type for p in trainer.state.model.parameters()})
    out["initial"] = {k: v.detach().clone() for k, v in make_model().state_dict().items()}
    return out
