"""`RunPlan`: the run's decisions, made once on the driver from the `RunSpec` (no Ray started here)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.mixture import Mixture
from raytrain_events.core.mixture_plan import MixtureRun
from raytrain_events.data.order import EpochOrder, GlobalBatch, RowShuffle, TrainOrder
from raytrain_events.parallel.config import FSDPConfig
from raytrain_events.ray.driver import RayTrainer


def _trainer(**over):
    base = dict(model=lambda: None, optimizers=lambda m: None, datasets={"train": object()}, max_duration="2ep")
    base.update(over)
    return RayTrainer(**base)


def test_the_global_batch_is_decided_once_for_any_world_size():
    """Rows per step: batch_size x the data-parallel ranks (TP ranks share rows), or global_batch_size."""
    plan = _trainer(batch_size=8, num_workers=8, parallelism=FSDPConfig(tensor_parallel=2)).plan
    assert plan.batch == GlobalBatch(8, None, 2) and plan.global_batch == 32  # 4 data-parallel ranks x 8
    assert plan.batch.rows(4) == 16 and plan.batch.readers(4) == 2  # an elastic group of 4: sized at its start
    fixed = _trainer(batch_size=8, num_workers=4, global_batch_size=96).plan
    assert fixed.global_batch == 96 and fixed.batch.rows(2) == 96 and fixed.batch.readers(2) == 2
    whole = _trainer(batch_size=8, num_workers=4).plan.batch.at(4)  # replica groups: the whole batch at any quorum
    assert whole.rows(1) == whole.rows(3) == 32
    elastic = _trainer(batch_size=8, scaling_config={"num_workers": (2, 6)}).plan
    assert elastic.global_batch is None and elastic.batch.rows(6) == 48


def test_the_train_order_shuffles_only_with_a_seed_and_a_window():
    assert _trainer(seed=3, shuffle_buffer_size=300).plan.order == TrainOrder(3, 300)
    assert _trainer(seed=3).plan.order == TrainOrder(None, None)
    assert TrainOrder(3, 300).of_epoch(2) == EpochOrder(3, RowShuffle(3, 2, 300))
    assert TrainOrder(None, 300).of_epoch(2) == EpochOrder() and EpochOrder().window_rows == 0


def test_the_mixture_run_and_checkpoint_plan_are_made_once_and_travel_as_they_are():
    mixture = Mixture(sources={"web": 80, "code": 20}, stages={"0dur": {"web": 0.8, "code": 0.2}, "10ba": {"code": 1}})
    trainer = _trainer(
        datasets={"web": object(), "code": object()},
        mixture=mixture,
        batch_size=4,
        num_workers=2,
        seed=5,
        run_name="planned",
        checkpoint=CheckpointConfig(save_interval="5ba", keep=2),
    )
    plan = trainer.plan
    # 'dur' stages from the run's samples (2 epochs of 100), 'ba' stages from the plan's global batch (8).
    assert plan.mixture == MixtureRun(mixture, 5, 200, 8)
    assert plan.mixture.plan().epoch_size == 100
    assert plan.checkpoint is not None and plan.checkpoint.worker.save_folder.startswith(trainer.run_url)
    assert plan.checkpoint.num_to_keep == 2  # Ray Train keeps two: the workers never prune
    assert pickle.loads(pickle.dumps(plan)) == plan  # shipped in Ray Train's train_loop_config as it is
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.order = TrainOrder()  # type: ignore[misc]
    assert _trainer().plan.mixture is None and _trainer().plan.checkpoint is None
