"""Rank functions for pipeline parallelism (importable by spawned ranks).

The model is the example transformer (examples/transformer_lm.py) with 4 blocks, built on the meta
device. The ``p`` stages of a pipeline (consecutive ranks) load the same batches: the data shard is
``rank // data_group``, or the library's data-parallel rank (`Parallel.data_parallel`, which
``pipeline_outermost`` changes) where given; the DDP reference on 2 ranks shards it by rank, so both train on the same
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
from raytrain_events.parallel.config import parse_parallelism
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
    """Counts the per-batch and per-microbatch events this rank fires, what the loss was at BATCH_END,
    and the eval metrics this rank logged at each EVAL_END."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        self.losses: List[float] = []
        self.evals: List[Dict[str, float]] = []

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        if event.name in COUNTED:
            self.counts[event.name] = self.counts.get(event.name, 0) + 1
        if event.name == "BATCH_END":
            self.losses.append(float(state.loss))
        if event.name == "EVAL_END":
            self.evals.append({k: float(v) for k, v in logger.metrics.items() if k.startswith("metrics/")})


class TokenMetric:
    """Next-token cross-entropy or accuracy over every token seen, as a metric the evaluation loop
    runs (torchmetrics' protocol as it uses it: ``to``, ``reset``, ``update``, ``compute`` synced over
    ``process_group``), so the spawned ranks need not import torchmetrics (seconds each on a loaded
    machine; the RayTrainer PP run evaluates a torchmetrics metric). ``compute`` sums (total, count)
    over the process group: one all-reduce, on the ranks that compute."""

    def __init__(self, kind: str) -> None:
        self.kind, self.process_group = kind, None
        self.reset()

    def reset(self) -> None:
        self.total = torch.zeros(2, dtype=torch.float64)

    def to(self, device: Any) -> TokenMetric:
        self.total = self.total.to(device)
        return self

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        if self.kind == "accuracy":
            value = (logits.argmax(-1) == targets).sum().double()
        else:
            value = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").double()
        self.total += torch.stack([value, torch.tensor(float(targets.numel()), dtype=torch.float64)])

    def compute(self) -> torch.Tensor:
        total = self.total.clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total, group=self.process_group)
        return (total[0] / total[1]).float()


def metered_lm(depth: int) -> torch.nn.Module:
    """The example transformer with eval metrics: next-token cross-entropy and accuracy (`TokenMetric`)."""
    from examples.transformer_lm import TransformerLM, next_tokens

    class MeteredLM(TransformerLM):
        def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
            return {"cross_entropy": TokenMetric("cross_entropy"), "accuracy": TokenMetric("accuracy")}

        def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Any) -> None:
            targets = next_tokens(batch)[:, :-1].reshape(-1)
            metric.update(outputs[:, :-1].reshape(-1, outputs.shape[-1]), targets)

    return MeteredLM(depth=depth)


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
    evaluate: bool = False,
    algorithms: Optional[List[Any]] = None,
    callbacks: Optional[List[Any]] = None,
    shard: Optional[int] = None,
    hidden_only: bool = False,
    rows: Optional[List[Any]] = None,
    **ckpt: Any,
) -> Trainer:
    """The 4-block transformer (on meta when ``meta``) with AdamW and norm clipping (threshold 0.1,
    so the whole model's norm decides every step); DDP runs 2 microbatches as the pipelines do.
    ``evaluate``: an eval set of 16 rows per data shard, evaluated every 4 batches. An `EMA` of the
    weights (smoothing 0.5) runs in every layout: under PP each rank averages its stages' parameters.
    ``hidden_only``: the model without its ``pipeline_block`` hook (stages call ``block(hidden)`` and
    send the hidden state only, the protocol's plain form). ``rows``: the training rows in place of
    this shard's random tokens."""
    from examples.transformer_lm import random_tokens
    from raytrain_events.algorithms.ema import EMA
    from raytrain_events.checkpoint import CheckpointConfig

    shard = rank // data_group if shard is None else shard
    torch.manual_seed(0)  # the same initial weights on every rank and for every layout
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = metered_lm(depth=4)
    if hidden_only:
        model.pipeline_block = None  # not callable: the stages run without the hook
    checkpoint = None
    if folder is not None:
        config = dict(save_folder=folder, save_interval="2ba", lock_run_dir=False, save_every_n_seconds=None)
        config.update(ckpt)
        checkpoint = CheckpointConfig(**config)
    pipelined = isinstance(parallelism, dict) and parallelism.get("pipeline_parallel", 1) > 1
    return Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(32, seed=100 + shard) if rows is None else rows, batch_size=8),
        max_duration=max_duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=2e-3),
        grad_accum=1 if pipelined else 2,
        parallelism=parallelism,
        algorithms=[GradientClipping("norm", 0.1), EMA(smoothing=0.5)] if algorithms is None else algorithms,
        callbacks=[EventCounter()] if callbacks is None else callbacks,
        checkpoint=checkpoint,
        eval_dataloader=DataLoader(random_tokens(16, seed=200 + shard), batch_size=8) if evaluate else None,
        eval_interval="4ba",
    )


def _eval_and_predict(trainer: Trainer, shard: int) -> Dict[str, Any]:
    """After fit: `Trainer.eval` on another set and `Trainer.predict`'s outputs (2 batches of 4 rows)."""
    from examples.transformer_lm import random_tokens

    evaluated = trainer.eval(DataLoader(random_tokens(12, seed=300 + shard), batch_size=6))
    outputs = trainer.predict(DataLoader(random_tokens(8, seed=400 + shard), batch_size=4))
    return {"eval": {k: float(v) for k, v in evaluated.items()}, "predict": torch.cat(outputs)}


def ema_state(trainer: Trainer) -> Dict[str, torch.Tensor]:
    """The EMA's averages this rank holds (its stages' under PP), as full tensors."""
    ema = trainer.state.algorithms[1]
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in ema.ema_model_state().items()
    }


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
        "evals": state.callbacks[0].evals,
        "ema": ema_state(trainer),
    }


def train_ddp(rank: int, world_size: int) -> Dict[str, Any]:
    """The reference: DDP on 2 ranks, one data shard each."""
    trainer = pp_trainer(rank, "ddp", meta=False, evaluate=True)
    trainer.fit()
    return {**_result(trainer), **_eval_and_predict(trainer, rank)}


def train_schedules(rank: int, world_size: int, configs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each config in turn on the same ranks, each rank loading its data-parallel rank's shard; a
    result each (this rank's stage's full parameters)."""
    out = []
    for config in configs:
        shard = parse_parallelism(config).data_coordinates(rank, world_size)[0]  # what a user shards by
        trainer = pp_trainer(rank, config, evaluate=True, shard=shard)
        trainer.fit()
        assert trainer.parallel.data_parallel(rank, world_size)[0] == shard
        result = {**_result(trainer), **_eval_and_predict(trainer, shard), "shard": shard}
        pipeline = trainer.parallel.pipeline
        assert pipeline is not None
        result["stages"] = pipeline.stage_indices
        context = pipeline.context  # context parallelism: (degree, this rank's index in its group)
        result["context"] = (context.degree, context.index) if context is not None else None
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
    out: Dict[str, Any] = {"pp2_saved": {**snapshot(trainer), "ema": ema_state(trainer)}}
    trainer.close()
    pp4 = pp_config("1f1b", degree=4, pipeline_microbatches=4)
    trainer = pp_trainer(rank, pp4, "3ba", 4, folder, autoresume=True, save_interval="1ba")
    out["pp4_loaded"] = {**snapshot(trainer), "ema": ema_state(trainer)}
    trainer.fit()
    out["pp4_saved"] = {**snapshot(trainer), "ema": ema_state(trainer)}
    trainer.close()
    return out


class PlantSpike(Callback):
    """Scales the loss of batch ``at`` (each microbatch's, at AFTER_LOSS: the last stage's under PP) by 50."""

    def __init__(self, at: int) -> None:
        self.at = at

    def after_loss(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.at:
            state.loss = state.loss * 50


def pp_hops_and_spike(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """`pp_checkpoint_hops`, `pp_spike`, a mis-sharded outermost pipeline (its stages load consecutive
    ranks' shards: the error each rank raised), a packed batch for a model without ``pipeline_block``
    and a PP 2 x CP 2 batch whose sequence the context split cannot cut (the error each rank raised)
    in one spawn of 4 ranks (a spawn and its imports cost seconds)."""
    out = {"hops": pp_checkpoint_hops(rank, world_size, folder), "spike": pp_spike(rank, world_size)}
    trainer = pp_trainer(rank, pp_config("1f1b", pipeline_outermost=True), "1ba", 2, algorithms=[])
    try:
        trainer.fit()
        out["mis-sharded"] = "trained"
    except ValueError as e:
        out["mis-sharded"] = str(e)
    trainer.close()
    from tests.parallel.doc_mask_workloads import packed_rows

    packed = packed_rows(8, seed=100 + rank // 2)  # a packed batch, and a model whose stages cannot mask it
    trainer = pp_trainer(rank, pp_config("1f1b"), "1ba", 2, algorithms=[], hidden_only=True, rows=packed)
    try:
        trainer.fit()
        out["packed-unmasked"] = "trained"
    except ValueError as e:
        out["packed-unmasked"] = str(e)
    trainer.close()
    from examples.transformer_lm import random_tokens

    short = random_tokens(8, length=14)  # PP 2 x CP 2: 14 positions, which 2 x 2 load-balanced chunks cannot cut
    trainer = pp_trainer(rank, pp_config("1f1b", context_parallel=2), "1ba", 4, algorithms=[], rows=short)
    try:
        trainer.fit()
        out["uncuttable"] = "trained"
    except ValueError as e:
        out["uncuttable"] = str(e)
    trainer.close()
    return out


def pp_spike(rank: int, world_size: int) -> Dict[str, Any]:
    """`SpikeGuard` (no clipping: the norm it judges is its own) over DDP on the 4 ranks (each data
    shard on 2 of them: DDP's mean gradient is the 2-shard one) and over PP 2 x DP 2, a 50x loss
    planted in the 4th batch of 5: what each guard judged and did, and the trained model. The PP arm's
    model has no ``pipeline_block`` hook: the plain protocol's stages, checked against DDP here."""
    from raytrain_events.callbacks import SpikeGuard

    out: Dict[str, Any] = {}
    for name, parallelism in (("ddp", "ddp"), ("pp", pp_config("1f1b"))):
        guard = SpikeGuard(snapshot_interval=2, window=20, warmup=2)
        judged: List[float] = []  # every gradient norm the guard judged, the spiking batch's too
        observe = guard.detector.observe
        guard.detector.observe = lambda loss, norm=None, seen=judged, judge=observe: (
            seen.append(norm),
            judge(loss, norm),
        )[1]  # type: ignore[method-assign]
        trainer = pp_trainer(
            rank,
            parallelism,
            "5ba",
            2,
            meta=name == "pp",
            algorithms=[],
            callbacks=[guard, PlantSpike(3)],
            hidden_only=name == "pp",  # the stages send the hidden state only (no pipeline_block)
        )
        if name == "pp":
            assert trainer.parallel.pipeline is not None
            assert not any(m.passes_index for m in trainer.parallel.pipeline.modules)
        trainer.fit()
        out[name] = {
            "rollbacks": [{k: r[k] for k in ("batch", "spike_batch", "restored_batch")} for r in guard.rollbacks],
            "norms": judged,
            "model": full_model_state(trainer.state.model),
        }
        trainer.close()
    return out
