"""FSDP x TP set-up: the option's checks, the mesh, and the refusals of a model without a plan or
with a plan that cannot split (no process group), and of a tensor group fed different batches
(2 gloo ranks). Training equivalence is in test_fsdp_training.py, checkpoints in test_reshard_matrix.py."""

from __future__ import annotations

import pytest
import torch

from examples.transformer_lm import Block, TransformerLM
from raytrain_events.parallel import FSDPConfig, apply_tensor_parallel
from raytrain_events.parallel.wrap import Parallel


def test_mesh_shape_names_and_bad_options():
    config = FSDPConfig(tensor_parallel=2)
    assert config.mesh_shape(4) == (2, 2) and config.mesh_shape(2) == (1, 2)
    assert config.mesh_dim_names() == ("shard", "tensor")
    assert FSDPConfig(replicate=2).mesh_dim_names() == ("replicate", "shard")
    with pytest.raises(ValueError, match=r"tensor_parallel=2\) needs a world size divisible by 2, got 3 ranks"):
        config.mesh_shape(3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel=.* must be an integer >= 1"):
            FSDPConfig(tensor_parallel=bad)  # type: ignore[arg-type]
    hsdp_tp = FSDPConfig(replicate=2, tensor_parallel=2)  # HSDP x TP: a 3-D mesh
    assert hsdp_tp.mesh_dim_names() == ("replicate", "shard", "tensor")
    assert hsdp_tp.mesh_shape(4) == (2, 1, 2) and hsdp_tp.mesh_shape(16) == (2, 4, 2)
    with pytest.raises(ValueError, match=r"replicate=2, tensor_parallel=2\) needs a world size divisible by 4, got 6"):
        hsdp_tp.mesh_shape(6)


def test_data_parallel_coordinates_and_counting():
    parallel = Parallel(FSDPConfig(tensor_parallel=2))
    assert [parallel.data_parallel(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [parallel.counts_data(r, 4) for r in range(4)] == [True, False, True, False]
    plain = Parallel("fsdp")
    assert plain.data_parallel(3, 4) == (3, 4) and all(plain.counts_data(r, 4) for r in range(4))


def test_model_without_a_plan_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no submodule of Sequential has a tensor_parallel_plan\(degree\)"):
        apply_tensor_parallel(model, None, 2)


class _Planned(torch.nn.Module):
    def __init__(self, plan: dict, width: int = 4) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.plan = plan

    def tensor_parallel_plan(self, degree: int) -> dict:
        return self.plan


@pytest.mark.parametrize(
    "plan, degree, message",
    [
        (
            {"missing": "colwise"},
            2,
            r"names 'missing', which is not a submodule of it; its submodules are \['fc', 'norm'\]",
        ),
        ({"norm": "colwise"}, 2, r"'norm' is a LayerNorm; the 'colwise' style splits torch.nn.Linear layers only"),
        ({"fc": "colwise"}, 4, r"fc has 6 output features, which 4 tensor-parallel ranks cannot split evenly"),
        ({"fc": "rowwise"}, 3, r"fc has 4 input features, which 3 tensor-parallel ranks cannot split evenly"),
        ({"fc": "sideways"}, 2, r"'fc': 'sideways' is not a style. Fix: use 'colwise', 'rowwise'"),
        ({}, 2, r"returned \{\}; it must return a non-empty dict"),
    ],
)
def test_bad_plans_are_refused_naming_the_layer(plan, degree, message):
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(_Planned(plan), None, degree)


def test_example_transformer_plan_needs_heads_divisible_by_degree():
    assert set(Block(32, 4).tensor_parallel_plan(2)) == {"attn.q", "attn.k", "attn.v", "attn.out", "mlp.fc", "mlp.proj"}
    with pytest.raises(ValueError, match="Block has 4 attention heads, which 3 tensor-parallel ranks cannot split"):
        apply_tensor_parallel(TransformerLM(heads=4), None, 3)


def test_tensor_parallel_on_one_process_is_refused():
    from torch.utils.data import DataLoader

    from examples.transformer_lm import random_tokens
    from raytrain_events import Trainer

    model = TransformerLM()
    with pytest.raises(ValueError, match=r"tensor_parallel=2\) needs 2 or more ranks, but this run has one process"):
        Trainer(
            model=model,
            train_dataloader=DataLoader(random_tokens(8), batch_size=4),
            max_duration="1ba",
            optimizers=torch.optim.AdamW(model.parameters()),
            parallelism=FSDPConfig(tensor_parallel=2),
        )


def test_tensor_group_fed_different_batches_is_refused_on_every_rank():
    from tests.parallel.spawn import run_ranks
    from tests.parallel.tp_workloads import tp_with_per_rank_data

    errors = run_ranks(2, tp_with_per_rank_data)
    for error in errors:
        assert "tensor_parallel=2: the ranks of tensor groups [[0, 1]] got different batches" in error
        assert "DistributedSampler(num_replicas=world_size // tensor_parallel" in error


def test_eval_metrics_count_each_row_once_under_tensor_parallelism():
    """Both ranks of a tensor group evaluate the same rows; synced over every rank, a sum counted them twice."""
    from tests.parallel.spawn import run_ranks
    from tests.parallel.tp_workloads import tp_eval_counts

    results = run_ranks(2, tp_eval_counts)
    assert [r["rows"] for r in results] == [12.0, 12.0]
    assert results[0]["loss"] == results[1]["loss"] > 0


def test_transformer_example_trains_in_one_process():
    from examples.transformer_lm import main

    assert main([]) == 0
