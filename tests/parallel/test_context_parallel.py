"""Context parallelism on gloo ranks: CP 2 (FSDP over the CP ranks), CP 2 x TP 2 and HSDP x CP 2x2 train the
example transformer with each row's sequence split (load-balanced chunks) to DDP's loss, gradients
and parameters on the same global batches, counting each row's tokens once; and the refusals."""

from __future__ import annotations

import pytest
import torch

from raytrain_events.parallel import FSDPConfig
from raytrain_events.parallel.context_parallel import (
    check_model,
    context_parallel_attention,
    load_balanced_positions,
    split_token_batch,
)
from tests.parallel.cp_workloads import train_cp
from tests.parallel.spawn import run_ranks

BATCHES, ROWS, LENGTH = 4, 8, 16


def _check_against_ddp(results, arm, group, reference="ddp"):
    for rank, got in enumerate(results):
        ddp, cp = got[reference], got[arm]
        assert ddp["lengths"] == [LENGTH] * 2 * BATCHES  # 2 microbatches per batch
        assert cp["lengths"] == [LENGTH // 2] * 2 * BATCHES, arm  # each rank ran half of every sequence
        # Tokens and samples: once per CP (x TP) group, exact; DDP's ranks each count the shared rows.
        groups = len(results) // group
        assert cp["timestamp"]["token"] == BATCHES * ROWS * LENGTH * groups
        assert cp["timestamp"]["sample"] == BATCHES * ROWS * groups
        assert ddp["timestamp"]["token"] == BATCHES * ROWS * LENGTH * len(results)
        # Every rank's state.loss is the unsplit model's loss (its CP group's mean), batch by batch.
        torch.testing.assert_close(cp["losses"], ddp["losses"], rtol=1e-6, atol=0)
        assert ddp["grads"].keys() == cp["grads"].keys()
        for name, grad in ddp["grads"].items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(cp["grads"][name], grad, rtol=0, atol=2e-6, msg=f"{arm} grad {name} rank {rank}")
        # Evaluation runs whole rows; its metrics sync over one rank per CP (x TP) group: each row once.
        assert cp["eval"]["rows"] == 12 * groups and ddp["eval"]["rows"] == 12 * len(results)
        assert cp["eval"]["loss"] == pytest.approx(ddp["eval"]["loss"], rel=1e-4)
        for name, value in ddp["model"].items():  # after 4 AdamW steps
            torch.testing.assert_close(cp["model"][name], value, rtol=0, atol=5e-5, msg=f"{arm} {name} rank {rank}")


def test_context_parallel_2_matches_ddp_and_counts_tokens_once():
    _check_against_ddp(run_ranks(2, train_cp, ["ddp", "cp"], 2), "cp", 2)


def test_context_parallel_2_with_tensor_parallel_2_or_hsdp_matches_ddp():
    """On one spawn of 4 ranks: CP 2 x TP 2 (one group of 4), and HSDP x CP, replicas of 2 x CP 2
    (each replica's CP pair splits its rows' sequences, gradients all-reduced across the replicas),
    each against DDP on the same rows: loss, gradients, parameters, tokens once per group."""
    groups = {"ddp": 4, "cp_tp": 4, "ddp_pairs": 2, "hsdp_cp": 2}
    results = run_ranks(4, train_cp, list(groups), groups)
    _check_against_ddp(results, "cp_tp", 4)
    _check_against_ddp(results, "hsdp_cp", 2, reference="ddp_pairs")


def test_load_balanced_split_and_labels():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    ids = torch.arange(16).view(2, 8)
    part = split_token_batch({"input_ids": ids, "other": 1}, 0, 2)
    assert part["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert part["labels"].tolist() == [[1, 2, 7, -100], [9, 10, 15, -100]]  # shifted before the cut
    assert part["positions"].tolist() == [0, 1, 6, 7] and part["other"] == 1
    assert float(part["label_count"]) == 2 * 7 / 2
    with pytest.raises(ValueError, match="cuts each sequence into 4 equal chunks .* has 6 positions. Fix"):
        load_balanced_positions(6, 2, 0)


def test_unsupported_combinations_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"context_parallel=2, activation_checkpointing=True\) is not supported.*Fix"):
        FSDPConfig(shard_modules=["Block"], context_parallel=2, activation_checkpointing=True)
    with pytest.raises(ValueError, match="context_parallel=0 must be an integer >= 1"):
        FSDPConfig(context_parallel=0)
    config = FSDPConfig(context_parallel=2, tensor_parallel=2, replicate=2)
    assert config.mesh_dim_names() == ("replicate", "shard", "context", "tensor")
    assert config.mesh_shape(16) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match=r"context_parallel=2, tensor_parallel=2\) needs a world size divisible by 4"):
        config.mesh_shape(6)
    with pytest.raises(ValueError, match=r"Sequential has no context_parallel_split\(batch, index, degree\).*Fix"):
        check_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(NotImplementedError, match="this call passed another attn_mask. Fix: is_causal=True"):
        context_parallel_attention(
            q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool), group=None, degree=2, positions=None
        )


def test_context_parallel_on_one_process_is_refused():
    from torch.utils.data import DataLoader

    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events import Trainer

    model = TransformerLM()
    with pytest.raises(ValueError, match=r"context_parallel=2\) needs 2 or more ranks, but this run has one process"):
        Trainer(
            model=model,
            train_dataloader=DataLoader(random_tokens(8), batch_size=4),
            max_duration="1ba",
            optimizers=torch.optim.AdamW(model.parameters()),
            parallelism=FSDPConfig(context_parallel=2),
        )


def test_ray_trainer_refuses_workers_that_context_groups_cannot_divide():
    from raytrain_events import RayTrainer

    options = dict(model=lambda: None, optimizers=lambda m: None, datasets={"train": object()}, max_duration="1ep")
    RayTrainer(**options, num_workers=4, parallelism=FSDPConfig(context_parallel=2, tensor_parallel=2))
    with pytest.raises(ValueError, match=r"context_parallel=2, tensor_parallel=2\) needs a world size divisible by 4"):
        RayTrainer(**options, num_workers=6, parallelism=FSDPConfig(context_parallel=2, tensor_parallel=2))
    with pytest.raises(ValueError, match=r"context_parallel=2\) needs a world size divisible by 2, got 3 ranks"):
        RayTrainer(**options, num_workers=3, parallelism=FSDPConfig(context_parallel=2))
