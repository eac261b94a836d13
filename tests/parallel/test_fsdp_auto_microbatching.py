"""``grad_accum="auto"`` under FSDP on 2 gloo ranks: one rank runs out of (simulated) device memory
in the middle of forward or backward, between FSDP's collectives, and nobody hangs.

The proofs: both ranks end at the same microbatch count; the retried batch keeps no gradient of a
failed attempt (the parameters are bit-for-bit those of a run started at the final count, or of
the same run switched to it at that batch); the Timestamp counts each batch once; the whole spawn
is bounded by a timeout, so a rank left waiting in a collective fails the test instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.fsdp_oom_workloads import fsdp_auto_runs
from tests.parallel.spawn import run_ranks
from tests.parallel.workloads import make_model

RUNS = [
    dict(grad_accum=4),  # 0: the reference, started at the final count
    dict(grad_accum="auto", oom_rank=1, where="forward", step=0),  # 1: rank 1 fails in Block 1's forward
    dict(grad_accum="auto", oom_rank=0, where="backward", step=0),  # 2: rank 0 fails in Block 1's backward
    dict(grad_accum="auto", oom_rank=1, where="forward", step=2),  # 3: at the third batch
    dict(grad_accum="auto", switch_at=2),  # 4: its reference: no error, 4 microbatches from the third batch on
]


@pytest.fixture(scope="module")
def runs():
    # one spawn for all runs; a rank stranded in a collective would end it at the timeout
    ranks = run_ranks(2, fsdp_auto_runs, RUNS, timeout=300)
    return [[ranks[rank][i] for rank in range(2)] for i in range(len(RUNS))]


def _equal(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("index", [1, 2])
def test_an_oom_mid_forward_or_backward_on_one_rank_is_agreed_and_equals_starting_at_the_final_count(runs, index):
    fixed, auto = runs[0], runs[index]
    failing = RUNS[index]["oom_rank"]
    assert all(r["sharded"] for r in auto)
    assert [r["grad_accum"] for r in auto] == [4, 4]  # both ranks retried at the same batch, twice
    assert auto[failing]["raised"] == [8, 4] and auto[1 - failing]["raised"] == []
    for r in auto:
        assert r["timestamp"]["batch"] == 6 and r["timestamp"]["sample"] == 6 * 2 * 8  # each batch counted once
        _equal(r["model"], fixed[0]["model"])
    assert auto[0]["checks"] == auto[1]["checks"]  # every check ran on both ranks


def test_an_oom_at_a_later_batch_equals_switching_there(runs):
    auto, switched = runs[3], runs[4]
    assert [r["grad_accum"] for r in auto] == [4, 4]
    assert auto[1]["raised"] == [8, 4]
    for r in auto:
        _equal(r["model"], switched[0]["model"])
    # and the retry changed something: the first two batches ran with one microbatch
    assert any(not torch.equal(auto[0]["model"][k], runs[0][0]["model"][k]) for k in auto[0]["model"])


def test_the_checks_cost_a_few_small_all_reduces_per_unit_and_microbatch(runs):
    """Per microbatch, one check per unit in forward, and in backward one per unit output and one per
    unit input that needs a gradient, plus FSDP's final callback; one per attempt at the batch."""
    switched = runs[4][0]  # no error: 2 batches of 1 microbatch, 4 batches of 4
    units = switched["units"]
    assert units == 4  # 3 Blocks and the root
    per_microbatch = units + units + 2 + 1  # forward; outputs; the inputs of Blocks 1 and 2; final callback
    assert switched["checks"] == (2 * 1 + 4 * 4) * per_microbatch + 6


def test_auto_is_refused_with_an_fsdp_reduce_dtype_it_cannot_discard():
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Trainer
    from raytrain_events.parallel.config import FSDPConfig

    model = make_model()
    data = DataLoader(TensorDataset(torch.randn(8, 16), torch.randint(0, 5, (8,))), batch_size=4)
    with pytest.raises(ValueError, match="grad_accum='auto' with FSDPConfig\\(reduce_dtype='fp32'.*Fix"):
        Trainer(
            model=model,
            train_dataloader=data,
            max_duration="1ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            grad_accum="auto",
            parallelism=FSDPConfig(param_dtype="bf16", reduce_dtype="fp32"),
        )
